"""Resident bytes per token of multi-head latent attention: the compressed latents against expanded K and V.

    python bench/mla_resident.py                      # under a minute on two cores
    python bench/mla_resident.py --out /tmp/mla.md

An MLA layer (DeepSeek V2/V3, Kimi K2, GLM-4-MoE-Lite, MiniCPM3, LongCat-Flash, ...) caches one latent of
`kv_lora_rank` and one rotary key of `qk_rope_head_dim` per token; its `expand_kv` turns them into keys of
`qk_nope_head_dim + qk_rope_head_dim` and values of `v_head_dim` for every head. The engine keeps the latents
resident and expands each piece once per step; a resident store of expanded K and V would hold the second
size. Two tables, markdown to stdout and `--out`:

1. **Measured**, on each MLA family's tiny model (the support check's config, `treetrain.models.support_table`):
   one forward fills a cache, and the bytes per token are read off the tensors it holds; the expanded bytes
   are read off what each layer's own `expand_kv` returns for them (the cached bytes include an indexed
   sparse attention layer's indexer keys, which the cache holds beside the latents). The ledger's
   `kv_bytes_per_token` is printed next to them; it must equal the cached bytes.
2. **At full size**, from each family's default config in transformers (the sizes its config class documents),
   in bfloat16: the same two quantities from the config's dimensions, per token over its MLA layers (a
   hybrid's linear-attention layers keep a constant-size state instead), and for a 32k-token resident prefix.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig

from treetrain.bytesize import format_bytes
from treetrain.io import atomic_write_text
from treetrain.memory.persistent import kv_bytes_per_token
from treetrain.models.recurrent_state import RECURRENT_LAYER_TYPES
from treetrain.models.support_table import families
from treetrain.models.tiny_family import tiny_family_config

TOKENS = 12
PREFIX = 32_768


@dataclass(frozen=True)
class Measured:
    family: str
    cached: int  # bytes per token the cache holds, all layers
    expanded: int  # bytes per token of the layers' expanded keys and values
    ledger: int  # kv_bytes_per_token


@dataclass(frozen=True)
class FullSize:
    family: str
    layers: int
    heads: int
    latent: int  # bf16 bytes per token, all layers
    expanded: int


def mla_families() -> list[str]:
    """Families whose text config has a `kv_lora_rank` (found in transformers, not listed by hand)."""
    found = []
    for family in families():
        try:
            config = AutoConfig.for_model(family).get_text_config(decoder=True)
            rank = getattr(config, "kv_lora_rank", None)
        except Exception:  # no default config, or a per-layer (heterogeneous) one: no row here
            continue
        if rank:
            found.append(family)
    return found


def measure(family: str) -> Measured | str:
    """The cache's bytes per token after one forward of the tiny model, and those of its expansion; or why
    the tiny model could not be measured."""
    try:
        return _measure(family)
    except Exception as exc:  # a tiny config this family's code refuses: the row says so
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _measure(family: str) -> Measured | str:
    config = tiny_family_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, int(config.get_text_config(decoder=True).vocab_size), (1, TOKENS))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        expanders = [m for m in model.modules() if callable(getattr(m, "expand_kv", None))]
        if not expanders:
            return "no layer with `expand_kv`"
        cached = expanded = 0
        for module in expanders:
            layer = cache.layers[int(module.layer_idx)]
            keys, values = layer.keys, layer.values  # [1, 1, T, r], [1, 1, T, R]
            cached += keys.nbytes + values.nbytes
            index_keys = getattr(layer, "indexer_keys", None)  # [1, T, D_index]: DSA's indexer, resident too
            cached += index_keys.nbytes if isinstance(index_keys, torch.Tensor) else 0
            k, v = module.expand_kv(keys, values)  # [1, H, T, Dqk], [1, H, T, Dv]
            expanded += k.nbytes + v.nbytes
    return Measured(family, cached // TOKENS, expanded // TOKENS, kv_bytes_per_token(model))


def full_size(family: str) -> FullSize:
    """Latent and expanded bytes per token of the family's default config, in bfloat16."""
    config: PretrainedConfig = AutoConfig.for_model(family).get_text_config(decoder=True)
    types = list(getattr(config, "layer_types", None) or [])
    recurrent = sum(t in RECURRENT_LAYER_TYPES for t in types)  # hybrids: only attention layers cache
    layers, heads = int(config.num_hidden_layers) - recurrent, int(config.num_attention_heads)
    latent = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    qk = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
    expanded = heads * (qk + int(config.v_head_dim))
    return FullSize(family, layers, heads, 2 * layers * latent, 2 * layers * expanded)


def report(measured: dict[str, Measured | str], full: list[FullSize]) -> str:
    lines = [
        f"## Measured on the tiny models (float32, one forward of {TOKENS} tokens)",
        "",
        "| family | cached per token | expanded K+V per token | expanded / cached | ledger per token |",
        "|---|---:|---:|---:|---:|",
    ]
    for family, m in measured.items():
        if isinstance(m, str):
            lines.append(f"| `{family}` | not measured: {m} | | | |")
            continue
        lines.append(
            f"| `{m.family}` | {m.cached} B | {m.expanded} B | {m.expanded / m.cached:.1f}x | {m.ledger} B"
            f"{'' if m.ledger == m.cached else ' (differs)'} |"
        )
    lines += [
        "",
        "## At full size (transformers' default config of each family, bfloat16)",
        "",
        "| family | MLA layers | heads | latent per token | expanded K+V per token | expanded / latent | "
        f"resident {PREFIX // 1024}k-token prefix: latent / expanded |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for f in full:
        lines.append(
            f"| `{f.family}` | {f.layers} | {f.heads} | {format_bytes(f.latent)} | {format_bytes(f.expanded)} | "
            f"{f.expanded / f.latent:.1f}x | {format_bytes(PREFIX * f.latent)} / {format_bytes(PREFIX * f.expanded)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/mla_resident.md"))
    args = parser.parse_args(argv)
    names = mla_families()
    measured = {f: measure(f) for f in names}
    text = report(measured, [full_size(f) for f in names])
    print(text)
    atomic_write_text(args.out, text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(isinstance(m, str) or m.ledger == m.cached for m in measured.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
