"""The trainer's in-memory weight layout turned back into the checkpoint layout an inference engine loads.

transformers 5 loads some families in a layout of its own: a mixture-of-experts layer's per-expert
`mlp.experts.{i}.gate_proj.weight`, `up_proj` and `down_proj` become two fused 3-D stacks,
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (and Mixtral's `block_sparse_moe` is renamed `mlp`).
vLLM's loaders read the checkpoint names, so the copy sent to it must undo that. transformers writes each
family's mapping once (`conversion_mapping.py`) and reverses it itself in `save_pretrained`
(`revert_weight_conversion`); `checkpoint_layout(model)` returns that same reversal as a function over the
tensors of one module at a time, so the weights still stream bucket by bucket (and, under ZeRO-3, module by
module), and no family's layout is written here by hand.

A family transformers keeps as its checkpoint has no conversion, and its tensors pass through unchanged.

Example (a mixture-of-experts layer's fused stacks, as qwen3_moe holds them, back to per-expert weights):
    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> config = Qwen3MoeConfig(vocab_size=8, hidden_size=8, moe_intermediate_size=4, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=2, num_experts_per_tok=1)
    >>> model = Qwen3MoeForCausalLM(config)
    >>> experts = dict(model.model.layers[0].mlp.experts.named_parameters(prefix="model.layers.0.mlp.experts"))
    >>> sorted((name, tuple(t.shape)) for name, t in checkpoint_layout(model)(experts).items())[:3]
    [('model.layers.0.mlp.experts.0.down_proj.weight', (8, 4)), ('model.layers.0.mlp.experts.0.gate_proj.weight', (4, 8)), ('model.layers.0.mlp.experts.0.up_proj.weight', (4, 8))]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Layout = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""Named tensors of one module in memory -> the same weights under checkpoint names."""


def _conversions(model: Any) -> list[Any]:
    """The transforms transformers applies when loading `model` (those recorded by `from_pretrained`, else the
    family's default ones), without prefix changes: exactly what `save_pretrained` reverses."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # a transformers without conversions keeps the checkpoint layout in memory
        return []
    recorded = getattr(model, "_weight_conversions", None)
    if recorded is not None:
        return list(recorded)
    if not hasattr(model, "config"):
        return []
    found = get_model_conversion_mapping(model, add_legacy=False)
    return [c for c in found if not isinstance(c, PrefixChange)]


def checkpoint_layout(model: Any) -> Layout | None:
    """The reversal of `model`'s load-time conversion as a function over one module's named tensors, or None
    when transformers holds `model` in its checkpoint layout (see the module docstring)."""
    conversions = _conversions(model)
    if not conversions:
        return None
    from transformers.core_model_loading import revert_weight_conversion

    def convert(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = revert_weight_conversion(model, dict(named))
        return {name: t.contiguous() for name, t in out.items()}

    return convert


def unconverted_stack(model: Any) -> str | None:
    """The first parameter that stays a fused stack (more than 2 dimensions) in the checkpoint layout, which
    vLLM's loaders do not know, or None. Shapes only (meta tensors): it runs before any weight is gathered, and
    a ZeRO-3 parameter's full shape is its `ds_shape`."""
    layout = checkpoint_layout(model)
    for prefix, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        shapes = {f"{prefix}.{n}" if prefix else n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in params}
        if all(len(s) <= 2 for s in shapes.values()):
            continue
        if layout is None:
            return next(n for n, s in shapes.items() if len(s) > 2)
        meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
        try:
            converted = layout(meta)
        except Exception:  # a conversion that needs tensors of another module: not one treetrain streams
            return next(n for n, s in shapes.items() if len(s) > 2)
        left = [n for n, t in converted.items() if t.dim() > 2]
        if left:
            return left[0]
    return None
