"""Run-persistent and update-boundary bytes of a model: parameters, gradients, optimizer state, ZeRO.

These are per process, during an update window. With DeepSpeed ZeRO over a world of W processes, stage 1
partitions the optimizer state (AdamW's two moments and, for 16-bit parameters, the fp32 master copy) and
stage 3 also the parameters; under ZeRO-3 a rank then holds its partition plus the parameters in flight:
at most the module it runs and one module gathered for another rank (`treetrain.distributed.zero3_sync`),
booked as `in_flight`. Gradients are never partitioned inside the window: ranks run different numbers of
backward calls, so the backend defers every reduction to the step and each rank accumulates the full
gradient (stage 2 partitions them only at the step). The reference model is a full replica on every rank.
Offloading the optimizer moves its state to host memory; it is then reported as host bytes.

Example:
    >>> b = persistent_bytes(1_000_000, "bfloat16", zero_stage=3, world_size=4, optimizer=True,
    ...                      largest_module_params=10_000)
    >>> b.params, b.in_flight, b.grads, b.optimizer, b.master
    (500000, 40000, 2000000, 2000000, 1000000)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from treetrain.models.indexer_state import index_key_bytes_per_token
from treetrain.models.lora import Reference, is_adapter_param, reference_module, unwrap
from treetrain.models.recurrent_state import state_bytes_per_unit as recurrent_state_bytes
from treetrain.models.recurrent_state import unkeyed_layers

DTYPE_BYTES: dict[str, int] = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported parameter dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class PersistentBytes:
    """Bytes per process, by what they hold. `device` and `host` split them by where they live."""

    params: int
    """Policy parameters (this process's partition under ZeRO-3)."""
    grads: int
    """Accumulated parameter gradients (whole on every rank inside the window); booked as update-boundary."""
    optimizer: int
    """AdamW first and second moments, fp32 (partitioned from ZeRO-1)."""
    master: int
    """fp32 master weights kept for 16-bit parameters (partitioned from ZeRO-1)."""
    reference: int
    """The frozen reference model's parameters."""
    offloaded: bool = False
    """Optimizer state and master weights live in host memory."""
    in_flight: int = 0
    """ZeRO-3 on several ranks: gathered parameters on top of the partition, at most (two modules' worth:
    the one this rank runs and one gathered for another rank)."""

    @property
    def run_persistent(self) -> int:
        """Device bytes for the whole run: parameters (with those in flight), reference, and on-device
        optimizer state."""
        return (
            self.params
            + self.in_flight
            + self.reference
            + (0 if self.offloaded else self.optimizer + self.master)
        )

    @property
    def update_boundary(self) -> int:
        return self.grads

    @property
    def host(self) -> int:
        return self.optimizer + self.master if self.offloaded else 0


def persistent_bytes(
    num_params: int,
    dtype: str | torch.dtype,
    *,
    zero_stage: int = 0,
    world_size: int = 1,
    optimizer: bool = True,
    offload_optimizer: bool = False,
    reference_params: int = 0,
    reference_dtype: str | torch.dtype | None = None,
    largest_module_params: int = 0,
) -> PersistentBytes:
    """Per-process persistent bytes of a model of `num_params` trainable parameters (see module docstring).

    `optimizer=False` leaves out optimizer state (the engine alone, without a trainer stepping it).
    `largest_module_params` is the most parameters one module owns directly (what ZeRO-3 gathers at once).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_params < 0 or reference_params < 0 or largest_module_params < 0:
        raise ValueError("parameter counts must be >= 0")
    b = dtype_bytes(dtype)
    w = world_size

    def part(n: int, from_stage: int) -> int:
        return -(-n // w) if zero_stage >= from_stage else n

    moments = 8 * num_params if optimizer else 0
    master = 4 * num_params if optimizer and b < 4 else 0
    ref_b = dtype_bytes(reference_dtype) if reference_dtype is not None else b
    gathering = zero_stage == 3 and w > 1
    return PersistentBytes(
        params=part(num_params * b, 3),
        grads=num_params * b,
        optimizer=part(moments, 1),
        master=part(master, 1),
        reference=reference_params * ref_b,
        offloaded=offload_optimizer,
        in_flight=2 * largest_module_params * b if gathering else 0,
    )


def model_persistent_bytes(
    model: PreTrainedModel,
    *,
    ref_model: Reference | None = None,
    optimizer: bool = False,
    zero_stage: int = 0,
    world_size: int = 1,
    offload_optimizer: bool = False,
) -> PersistentBytes:
    """`persistent_bytes` of a loaded model: parameters counted, not estimated. Frozen parameters (a LoRA
    base) count as parameters only: no gradient, no optimizer state. A reference with adapters off shares
    the policy's weights and adds nothing."""
    ref_own = reference_module(ref_model)
    params = [p for p in model.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    dtype = params[0].dtype if params else torch.float32
    ref = sum(p.numel() for p in ref_own.parameters()) if ref_own is not None else 0
    ref_dtype = next(ref_own.parameters()).dtype if ref_own is not None else None
    out = persistent_bytes(
        trainable, dtype, zero_stage=zero_stage, world_size=world_size, optimizer=optimizer,
        offload_optimizer=offload_optimizer, reference_params=ref, reference_dtype=ref_dtype,
        largest_module_params=largest_module(model),
    )  # fmt: skip
    if frozen:  # partitioned under ZeRO-3 like the trainable ones
        out = replace(out, params=out.params + (-(-frozen // world_size) if zero_stage == 3 else frozen))
    return out


def full_finetune_bytes(
    model: PreTrainedModel,
    *,
    reference: bool = False,
    zero_stage: int = 0,
    world_size: int = 1,
    offload_optimizer: bool = False,
) -> PersistentBytes:
    """What `model_persistent_bytes(..., optimizer=True)` would be if every base weight trained (adapters
    removed), with a frozen copy as the reference when `reference`: the full fine-tuning LoRA is compared to.

    Example:
        >>> from treetrain.models.lora import LoraSection, apply_lora
        >>> from treetrain.models.presets import tiny_model
        >>> policy = apply_lora(tiny_model("llama", vocab_size=64), LoraSection(r=4))
        >>> lora = model_persistent_bytes(policy, optimizer=True)
        >>> full = full_finetune_bytes(policy)
        >>> lora.params - full.params, lora.grads, full.grads == full.params
        (7168, 7168, True)
    """
    params = [(n, p) for n, p in model.named_parameters() if not is_adapter_param(n)]
    count = sum(p.numel() for _, p in params)
    dtype = params[0][1].dtype if params else torch.float32
    return persistent_bytes(
        count, dtype, zero_stage=zero_stage, world_size=world_size, optimizer=True,
        offload_optimizer=offload_optimizer, reference_params=count if reference else 0,
    )  # fmt: skip


def largest_module(model: torch.nn.Module) -> int:
    """The most parameters any one module owns directly (not through children): the unit DeepSpeed's
    ZeRO-3 gathers per fetch.

    >>> largest_module(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    40
    """
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def state_bytes_per_unit(model: PreTrainedModel) -> int:
    """Resident bytes every unit holds whatever its length: the (conv, recurrent) state of each linear-attention
    layer, taken before the unit's last token (0 for a model of attention layers only)."""
    return recurrent_state_bytes(unwrap(model))


def unit_resident_bytes(length: int, per_token: int, per_unit: int) -> int:
    """Resident bytes of a unit of `length` tokens: its KV plus its constant recurrent state."""
    return length * per_token + per_unit


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Resident KV bytes of one token: what every layer's cache holds, in the model's dtype.

    That is keys and values per KV head, except that multi-head latent attention (`kv_lora_rank`) caches one
    latent and one rotary key per layer, indexed sparse attention (DeepSeek V3.2, GLM-5) adds its indexer's
    keys (`index_key_bytes_per_token`), and layers that reuse an earlier layer's KV (`num_kv_shared_layers`,
    Gemma 3n/4) or keep recurrent state instead (`state_bytes_per_unit`) cache nothing per token. The
    ledger books a unit's G at its resident bytes, so an indexed model's G is booked with the indexer keys'
    share too, which it does not hold (the indexer takes no gradient): an overestimate by that share.
    """
    config = model.config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    layers = int(config.num_hidden_layers) - int(getattr(config, "num_kv_shared_layers", None) or 0)
    layers -= len(unkeyed_layers(unwrap(model)))
    rank = getattr(config, "kv_lora_rank", None)
    per_layer = int(rank) + int(config.qk_rope_head_dim) if rank else 2 * kv_heads * head_dim
    return layers * per_layer * next(model.parameters()).element_size() + index_key_bytes_per_token(
        unwrap(model)
    )
