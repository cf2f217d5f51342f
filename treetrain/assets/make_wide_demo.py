"""Write `treetrain/assets/demo_model_wide/`: the demo checkpoint with attention heads of 64 dimensions.

vLLM's CPU attention has no kernel for the demo model's 16-dimensional heads (`Unsupported CPU attention
configuration: head_dim=16`); it serves 32, 64 and larger, and 64 is the common size. Retraining a model only to change its
head size would give a different policy, so this module widens the heads of the *same* model instead, with an
exactly equivalent function (up to float rounding):

- each query and key head's 16 dimensions go to dimensions `4i` (first half) and `32 + 4i` (second half) of a
  64-dimensional head, the rest zero. Rotary embeddings pair dimension `j` with `j + 32` at frequency
  `theta^(-2j/64)`; at `j = 4i` that is `theta^(-2i/16)`, the frequency dimension `i` had, so every score
  `q . k` is unchanged;
- the query weights are scaled by `sqrt(64 / 16) = 2`, undoing the change of the softmax scale from `1/4` to
  `1/8`;
- each value head's 16 dimensions are the first 16 of 64, and the output projection reads only those.

The wide model is `model.path: demo-wide`. `tests/assets/test_wide_demo.py` checks its logits against the
demo model's. Run (a second; deterministic):

    python -m treetrain.assets.make_wide_demo
"""

from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treetrain.io import atomic_directory

HERE = Path(__file__).resolve().parent
DEMO_DIR = HERE / "demo_model"
WIDE_DIR = HERE / "demo_model_wide"
WIDE_HEAD_DIM = 64
COPIED = ("chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _spread(weight: torch.Tensor, heads: int, old: int, new: int) -> torch.Tensor:
    """Rows of a q/k projection [heads * old, H] placed at the rotary-equivalent rows of [heads * new, H]."""
    half, stride = old // 2, new // old
    out = weight.new_zeros(heads, new, weight.shape[1])
    w = weight.view(heads, old, -1)
    idx = torch.arange(half) * stride
    out[:, idx] = w[:, :half]
    out[:, new // 2 + idx] = w[:, half:]
    return out.reshape(heads * new, -1)


def widen(model: Any, new_head_dim: int = WIDE_HEAD_DIM) -> Any:
    """An equivalent Llama whose attention heads have `new_head_dim` dimensions (see the module docstring)."""
    cfg: Any = model.config
    old, heads, kv_heads = int(cfg.head_dim), int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    if new_head_dim % old or old % 2:
        raise ValueError(f"cannot widen heads of {old} dimensions to {new_head_dim}")
    wide_cfg = LlamaConfig(**{**cfg.to_dict(), "head_dim": new_head_dim})
    wide: Any = LlamaForCausalLM(wide_cfg)
    wide.to(dtype=model.dtype)
    state = dict(model.state_dict())
    q_scale = math.sqrt(new_head_dim / old)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        q, k = state[p + "q_proj.weight"], state[p + "k_proj.weight"]
        v, o = state[p + "v_proj.weight"], state[p + "o_proj.weight"]
        state[p + "q_proj.weight"] = _spread(q, heads, old, new_head_dim) * q_scale
        state[p + "k_proj.weight"] = _spread(k, kv_heads, old, new_head_dim)
        wide_v = v.new_zeros(kv_heads, new_head_dim, v.shape[1])
        wide_v[:, :old] = v.view(kv_heads, old, -1)
        state[p + "v_proj.weight"] = wide_v.reshape(-1, v.shape[1])
        wide_o = o.new_zeros(o.shape[0], heads, new_head_dim)
        wide_o[:, :, :old] = o.view(o.shape[0], heads, old)
        state[p + "o_proj.weight"] = wide_o.reshape(o.shape[0], -1)
    wide.load_state_dict(state, strict=True)
    return wide


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WIDE_DIR)
    args = parser.parse_args(argv)
    model = LlamaForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32)
    wide = widen(model)
    with atomic_directory(args.out) as tmp:
        wide.save_pretrained(tmp)
        for name in COPIED:
            shutil.copy(DEMO_DIR / name, Path(tmp) / name)
    print(
        f"wrote {args.out} (head_dim {WIDE_HEAD_DIM}, {sum(p.numel() for p in wide.parameters()):,} parameters)"
    )


if __name__ == "__main__":
    main()
