"""The trainer's current weights, as an inference engine loads them: full tensors under checkpoint names.

`weight_buckets(model)` yields the weights in buckets of at most `bucket_bytes`, each a list of
`(checkpoint name, tensor)`. It takes the model as the trainer holds it:

- a DeepSpeed engine is unwrapped to its module;
- under ZeRO-3 each module's parameters are gathered with `deepspeed.zero.GatheredParameters`, one module
  at a time, and released once the bucket holding them has been yielded: the model is never whole on a rank;
- a tied weight goes under each of its names (`lm_head.weight` and `embed_tokens.weight`): vLLM's in-place
  reload reads the head from `lm_head.weight`;
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

BUCKET_BYTES = 256 * 2**20
"""Default bucket size: what a rank holds gathered at once under ZeRO-3."""


def _unwrap(model: Any) -> Any:
    return getattr(model, "module", model) if type(model).__name__ == "DeepSpeedEngine" else model


def _is_peft(model: Any) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "get_base_model")


def _partitioned(model: Any) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


@contextlib.contextmanager
def _merged(model: Any) -> Iterator[Any]:
    """The module whose parameters are the policy's weights under checkpoint names."""
    if not _is_peft(model):
        yield model
        return
    model.merge_adapter()
    try:
        yield model.get_base_model()
    finally:
        model.unmerge_adapter()


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
    if _is_peft(model) and _partitioned(model):
        raise NotImplementedError(
            "syncing LoRA weights into an inference engine under ZeRO-3 is not supported; use ZeRO 0-2 with LoRA"
        )
    with _merged(model) as base, torch.no_grad():
        gather = _partitioned(base)
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for prefix, module in base.named_modules(remove_duplicate=False):
            params = list(module.named_parameters(recurse=False, remove_duplicate=False))
            if not params:
                continue
            ctx: Any = contextlib.nullcontext()
            if gather:
                import deepspeed

                ctx = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
            with ctx:
                for n, p in params:
                    name = _checkpoint_name(f"{prefix}.{n}" if prefix else n)
                    if name is None:
                        continue
                    tensor = p.detach().clone() if gather else p.detach()
                    bucket.append((name, tensor))
                    size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket
