"""The trainer's current weights, as an inference engine loads them: full tensors under checkpoint names.

`weight_buckets(model)` yields the weights in buckets of at most `bucket_bytes`, each a list of
`(checkpoint name, tensor)`. It takes the model as the trainer holds it:

- a DeepSpeed engine is unwrapped to its module;
- under ZeRO-3 each module's parameters are gathered with `deepspeed.zero.GatheredParameters`, one module
  at a time, and released once the bucket holding them has been yielded: the model is never whole on a rank;
- a tied weight goes under each of its names (`lm_head.weight` and `embed_tokens.weight`): vLLM's in-place
  reload reads the head from `lm_head.weight`;
- weights transformers holds in a layout of its own (a mixture of experts' fused 3-D stacks) go out under
  the checkpoint's names, one module at a time (`treetrain.rollout.engines.expert_export`);
- a PEFT model has its adapters merged into the base weights for the copy and unmerged after, so the engine
  samples from exactly the policy being trained, under the base model's own parameter names.

The tensors are detached (and, for ZeRO-3, cloned out of the gathered buffers); the caller must consume a
bucket before asking for the next.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> [[name for name, _ in bucket] for bucket in weight_buckets(model, bucket_bytes=64)]
    [['0.weight', '0.bias'], ['1.weight', '1.bias']]
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch

from treetrain.rollout.engines.expert_export import checkpoint_layout, unconverted_stack

BUCKET_BYTES = 256 * 2**20
"""Default bucket size: what a rank holds gathered at once under ZeRO-3."""


def _unwrap(model: Any) -> Any:
    return getattr(model, "module", model) if type(model).__name__ == "DeepSpeedEngine" else model


def _is_peft(model: Any) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "get_base_model")


def partitioned(model: Any) -> bool:
    """Whether ZeRO-3 shards `model`'s parameters (each keeps its full shape in `ds_shape`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape as the model defines it: ZeRO-3 keeps it in `ds_shape` and empties the tensor."""
    return tuple(getattr(param, "ds_shape", param.shape))


def gathered(params: list[torch.Tensor]) -> Any:
    """The context that holds `params` whole: ZeRO-3's gather of those it shards (a collective every rank
    must enter), else none."""
    sharded = [p for p in params if hasattr(p, "ds_id")]
    if not sharded:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(sharded, modifier_rank=None)


def _lora_layers(model: Any) -> dict[int, Any]:
    """For a PEFT model, the LoRA layer adapting each base weight (by the weight's id). Each delta is computed
    when its weight's module is reached, so at most one module's deltas exist at a time."""
    if not _is_peft(model):
        return {}
    from peft.tuners.lora import LoraLayer

    return {
        id(module.get_base_layer().weight): module
        for module in model.modules()
        if isinstance(module, LoraLayer) and not module.disable_adapters
    }


def _delta(layer: Any, weight: torch.Tensor) -> torch.Tensor | None:
    """The summed delta of `layer`'s active adapters, computed out of place: merging into the weight and
    unmerging after would move the frozen base weights by rounding each time."""
    total: torch.Tensor | None = None
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            delta = layer.get_delta_weight(adapter).to(weight.dtype)
            total = delta if total is None else total + delta
    return total


def fused_experts(model: Any) -> str | None:
    """The first parameter that stays a fused stack (3-D) even in the checkpoint layout, which an inference
    engine's checkpoint loader does not know, or None (`expert_export.unconverted_stack`)."""
    model = _unwrap(model)
    return unconverted_stack(model.get_base_model() if _is_peft(model) else model)


def _checkpoint_name(name: str) -> str | None:
    """A PEFT-wrapped parameter's base name, or None for an adapter's own parameter (and for the frozen
    original of a module PEFT trains a copy of).

    >>> _checkpoint_name("model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> _checkpoint_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    True
    >>> _checkpoint_name("lm_head.modules_to_save.default.weight")
    'lm_head.weight'
    """
    if "lora_" in name or ".original_module." in name:
        return None
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name.replace(".base_layer.", "."))


def weight_buckets(model: Any, bucket_bytes: int = BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """See the module docstring."""
    model = _unwrap(model)
    if _is_peft(model) and partitioned(model):  # the trainer refuses this combination at start
        raise ValueError("LoRA weights are not synced into an inference engine under ZeRO-3")
    lora = _lora_layers(model)
    base = model.get_base_model() if _is_peft(model) else model
    layout = checkpoint_layout(base)
    with torch.no_grad():
        gather = partitioned(base)
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for prefix, module in base.named_modules(remove_duplicate=False):
            params = list(module.named_parameters(recurse=False, remove_duplicate=False))
            if not params:
                continue
            with gathered([p for _, p in params]):
                named: dict[str, torch.Tensor] = {}
                for n, p in params:
                    name = _checkpoint_name(f"{prefix}.{n}" if prefix else n)
                    if name is None:
                        continue
                    tensor = p.detach().clone() if gather else p.detach()
                    delta = _delta(lora[id(p)], tensor) if id(p) in lora else None
                    if delta is not None:
                        tensor = tensor + delta  # a new tensor: the trained base weight is untouched
                    named[name] = tensor
            if layout is not None and named:
                named = layout(named)
            for name, tensor in named.items():
                bucket.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket
