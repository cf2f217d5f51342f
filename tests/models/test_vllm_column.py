"""The support table's vLLM column names only tests that exist and run that family through a real vLLM, so
"checked" means a test does it; a family without such a test reads "not checked"."""

from __future__ import annotations

from pathlib import Path

from treetrain.models.support_table import VLLM_CHECKED, SupportRow

ROOT = Path(__file__).resolve().parents[2]


def test_each_checked_family_names_a_vllm_test_of_it() -> None:
    for family, test in VLLM_CHECKED.items():
        source = (ROOT / test).read_text()
        assert "VLLMEngine" in source or "vllm_engine" in source, test
        named = family.replace("_", "") if family != "llama" else "Llama"
        assert family in source or named in source, (family, test)


def test_the_column_reads_checked_only_for_those_families() -> None:
    assert (
        "| checked (`tests/rollout/test_vllm_moe.py`) |" in SupportRow("qwen3_moe", "accepted", "").markdown()
    )
    assert "| not checked |" in SupportRow("olmoe", "accepted", "").markdown()  # negative control
