"""docs/model-support.md is the support check's output: its family list is transformers' causal-LM list,
and its rows for a sample of families (each kind of row: accepted plain and with each kind of note,
refused for each kind of reason, not checked) match a live check. The whole page takes minutes to
regenerate on 2 cores, so the rest of its rows are checked only by regenerating it."""

from __future__ import annotations

from pathlib import Path

import pytest

from treetrain.models.support_table import COMMAND, families, render, support_row

PAGE = Path(__file__).resolve().parents[2] / "docs" / "model-support.md"
SAMPLE = (
    "llama", "deepseek_v3", "granite", "cohere", "gemma2", "gemma4_text", "gpt2", "bloom", "modernbert-decoder",
    "jetmoe", "openai-gpt", "xlstm", "diffllama", "dory", "llama4", "qwen3_5_text", "mamba", "kimi_linear",
)  # fmt: skip


def _rows() -> dict[str, str]:
    lines = [line for line in PAGE.read_text().splitlines() if line.startswith("| `")]
    return {line.split("`")[1]: line for line in lines}


def test_the_page_lists_every_causal_lm_family_of_this_transformers_once() -> None:
    rows = [line for line in PAGE.read_text().splitlines() if line.startswith("| `")]
    assert [line.split("`")[1] for line in rows] == list(families()), f"stale: regenerate with `{COMMAND}`"


def test_the_page_header_is_current() -> None:
    on_disk = PAGE.read_text()
    assert on_disk.startswith(render([]).split("\n0 families")[0]), f"stale: regenerate with `{COMMAND}`"


@pytest.mark.parametrize("family", SAMPLE)
def test_a_row_matches_a_live_check(family: str) -> None:
    assert _rows()[family] == support_row(family).markdown(), f"stale: regenerate with `{COMMAND}`"


def test_the_sample_covers_every_kind_of_row() -> None:
    """Negative control for the sample: it holds each status, so a page wrong in any of them is caught."""
    statuses = {_rows()[f].split(" | ")[1] for f in SAMPLE}
    assert statuses == {"accepted", "refused", "not checked"}
