"""`bench/mla_resident.py`: the bytes per token it reports are read off real caches, and the ledger agrees."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from support.scripts import load_script


def _script() -> ModuleType:
    return load_script("bench/mla_resident.py", "bench_mla_resident")


@pytest.mark.parametrize("family", ["deepseek_v3", "minicpm3"])
def test_cached_bytes_are_the_latents_and_the_ledger_prices_them(family: str) -> None:
    bench = _script()
    m = bench.measure(family)
    assert not isinstance(m, str), m
    config = bench.tiny_family_config(family)
    layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
    fp32 = 4
    assert m.cached == layers * (config.kv_lora_rank + config.qk_rope_head_dim) * fp32
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    assert m.expanded == layers * heads * (qk + config.v_head_dim) * fp32
    assert m.ledger == m.cached


def test_the_families_are_found_in_transformers_and_a_full_size_row_counts_only_mla_layers() -> None:
    bench = _script()
    found = bench.mla_families()
    assert {"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3"} <= set(found)
    assert "llama" not in found  # negative control: no latent, no row
    full = bench.full_size("kimi_linear")  # a hybrid: its linear-attention layers cache no latents
    config = bench.AutoConfig.for_model("kimi_linear")
    assert full.layers == list(config.layer_types).count("full_attention") < config.num_hidden_layers


def test_the_report_writes_every_row(tmp_path: Path) -> None:
    bench = _script()
    out = tmp_path / "mla.md"
    assert bench.main(["--out", str(out)]) == 0
    text = out.read_text()
    for family in bench.mla_families():
        assert text.count(f"| `{family}` |") == 2, family
