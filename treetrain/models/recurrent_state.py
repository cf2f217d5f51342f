"""Resident state of linear-attention layers: (conv state, recurrent state) at a unit's last token.

Why: a Gated DeltaNet layer (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo hybrid) carries no per-token KV. What
its later tokens read of the earlier ones is two constant-size tensors: the last `kernel - 1` inputs of its
causal depthwise convolution (`[1, C, kernel - 1]`) and the delta rule's matrix state (`[1, H_v, D_k, D_v]`,
float32, as the model's own kernel computes it). Those two are that layer's resident object; they sit in a
unit's per-layer entry where an attention layer keeps `(keys, values)`, and everything that stores,
evicts, offloads or accumulates G on resident KV handles them the same way.

Two things differ from KV, and this module does both:

- **Where the state is taken.** Each unit's children are fed the parent's last token again (the overlap),
  so the state a child continues is the one *before* the parent's last token, and it is taken per row of
  a right-padded batch. The model's own forward runs unchanged, with two seams: an `EngineCache` answers
  the layer's `get_conv_state` / `update_conv_state` / `get_recurrent_state` / `update_recurrent_state`
  (the resident state in, the captured state out, never written in place), and the layer's own delta-rule
  functions (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, looked up in the layer's
  module) are wrapped while a capture is active: positions from each row's capture point on neither decay
  nor update the state (`g = 0`, `beta = 0`), so the chunked rule ends at the captured state, and the last
  real token's output is one recurrent step from it. Both are the model's code, differentiable end to end.
- **How a path reads it.** Attention concatenates the KV of every unit on the path; a recurrent layer
  reads only the last unit's state. Its gradient goes into that unit's G accumulator (`_Into`), and the
  unit's closing backward adds <state, G> like <KV, G>.

Example:
    >>> from treetrain.models.presets import tiny_model
    >>> sorted(recurrent_layers(tiny_model("qwen3_5_text", 64)))
    [0, 2]
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer

from treetrain.models.shared_past import LayerKV, SharedPast, _Into

#: Layer types of transformers' configs whose layer carries recurrent state instead of KV.
RECURRENT_LAYER_TYPES = frozenset({"linear_attention"})
#: The delta-rule functions a Gated DeltaNet layer's module must define (the layer calls them by name).
RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
#: Attributes of a Gated DeltaNet layer that size its state (`state_bytes_per_unit`).
SIZE_FIELDS = ("conv_kernel_size", "key_dim", "value_dim", "num_v_heads", "head_k_dim", "head_v_dim")


def recurrent_layers(model: nn.Module) -> frozenset[int]:
    """Indices of the decoder layers whose state is recurrent (config `layer_types`), empty for KV models."""
    config = model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]
    types = list(getattr(config, "layer_types", None) or [])
    return frozenset(i for i, t in enumerate(types) if t in RECURRENT_LAYER_TYPES)


def mixers(model: nn.Module) -> dict[int, Any]:
    """The Gated DeltaNet module of each recurrent layer, by layer index (layers whose module is of another
    kind are missing: `unsupported_mixer` names them)."""
    wanted = recurrent_layers(model)
    found: dict[int, Any] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        sized = all(isinstance(getattr(module, f, None), int) for f in SIZE_FIELDS)
        if idx in wanted and sized and _rules_module(module) is not None:
            found[int(idx)] = module
    return found


def unsupported_mixer(model: nn.Module) -> str | None:
    """Why the recurrent layers cannot carry resident state, or None when every one can."""
    wanted = recurrent_layers(model)
    if not wanted:
        return None
    found = mixers(model)
    missing = sorted(wanted - set(found))
    if missing:
        kinds = sorted(
            {
                type(m).__name__
                for m in model.modules()
                if getattr(m, "layer_idx", None) in missing
                and not type(m).__name__.endswith(("Layer", "Block"))
            }
        )
        found_kinds = ", ".join(kinds) or "modules without a layer index"
        return (
            f"its recurrent layers {missing} (layer type 'linear_attention': {found_kinds}) are not Gated DeltaNet "
            f"layers calling {' / '.join(RULES)}; resident recurrent state (conv state, recurrent state) is "
            "implemented for Gated DeltaNet only"
        )
    return None


def _rules_module(module: nn.Module) -> Any:
    mod = sys.modules.get(type(module).__module__)
    return mod if mod is not None and all(callable(getattr(mod, r, None)) for r in RULES) else None


def state_bytes_per_unit(model: nn.Module) -> int:
    """Bytes of one unit's recurrent state over all recurrent layers: the conv window in the model's dtype
    and the delta rule's state in float32 (the model's kernel computes it in float32)."""
    size = next(model.parameters()).element_size()
    total = 0
    for module in mixers(model).values():
        conv = int(module.key_dim) * 2 + int(module.value_dim)
        kernel = int(module.conv_kernel_size)
        heads, dk, dv = int(module.num_v_heads), int(module.head_k_dim), int(module.head_v_dim)
        total += conv * (kernel - 1) * size + heads * dk * dv * 4
    return total


@dataclass
class _Capture:
    cut: torch.Tensor  # [B] index of each row's last real token: the state is taken before it


_CAPTURE: ContextVar[_Capture | None] = ContextVar("treetrain_recurrent_capture", default=None)
_ORIGINAL: dict[tuple[str, str], Callable[..., Any]] = {}


def _captured_rule(module_name: str) -> Callable[..., Any]:
    chunk = _ORIGINAL[(module_name, RULES[0])]
    step = _ORIGINAL[(module_name, RULES[1])]

    def rule(
        query: torch.Tensor,  # [B, T, H_k, D_k]
        key: torch.Tensor,  # [B, T, H_k, D_k]
        value: torch.Tensor,  # [B, T, H_v, D_v]
        g: torch.Tensor,  # [B, T, H_v]
        beta: torch.Tensor,  # [B, T, H_v]
        *args: Any,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        active = _CAPTURE.get()
        if active is None or args:
            raise RuntimeError("the captured delta rule ran outside a recurrent-state capture")
        kwargs.pop("chunk_size", None)
        cut = active.cut
        t = torch.arange(query.shape[1], device=query.device)
        before = (t[None, :] < cut[:, None]).to(g.dtype)[..., None]  # [B, T, 1]
        out, state = chunk(
            query, key, value, g=g * before, beta=beta * before.to(beta.dtype), initial_state=initial_state,
            output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs,
        )  # fmt: skip
        rows = torch.arange(query.shape[0], device=query.device)
        last, _ = step(
            query[rows, cut][:, None], key[rows, cut][:, None], value[rows, cut][:, None],
            g=g[rows, cut][:, None], beta=beta[rows, cut][:, None], initial_state=state,
            output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs,
        )  # fmt: skip  # [B, 1, H_v, D_v]
        out = out.index_put((rows, cut), last[:, 0].to(out.dtype))
        return out, state

    return rule


def _dispatch(module_name: str, name: str) -> Callable[..., Any]:
    """The layer module's function `name`: the captured rule while a capture is active, else the original."""
    original = _ORIGINAL[(module_name, name)]
    captured = _captured_rule(module_name)

    def call(*args: Any, **kwargs: Any) -> Any:
        return (original if _CAPTURE.get() is None else captured)(*args, **kwargs)

    call._treetrain_dispatch = True  # type: ignore[attr-defined]
    return call


def _install(module: nn.Module) -> None:
    """Route the layer module's delta-rule names through `_dispatch` (once per module; a no-op outside a capture)."""
    mod = _rules_module(module)
    assert mod is not None
    for name in RULES:
        if (mod.__name__, name) not in _ORIGINAL:
            _ORIGINAL[(mod.__name__, name)] = getattr(mod, name)
    for name in RULES:
        if not getattr(getattr(mod, name), "_treetrain_dispatch", False):
            setattr(mod, name, _dispatch(mod.__name__, name))


class EngineCache(DynamicCache):
    """A `DynamicCache` whose recurrent layers read their state from a resident past and record, per row,
    the state before each row's last real token (`captured`), instead of holding state of their own."""

    def __init__(
        self,
        n_layers: int,
        recurrent: frozenset[int],
        past: SharedPast | None,
        rows: int,
        anchor: torch.Tensor | None,
    ) -> None:
        layers: list[Any] = [DummyLayer() if i in recurrent else DynamicLayer() for i in range(n_layers)]
        super().__init__()
        self.layers = layers
        self.layer_class_to_replicate = None
        self.recurrent = recurrent
        self.rows = rows
        self._initial: dict[int, LayerKV] = {}
        if past is not None and past.pieces:
            last = past.pieces[-1]
            acc = past.grads[-1] if past.grads else None
            for i in recurrent:
                conv, state = last[i]
                if acc is not None and anchor is not None and anchor.requires_grad:
                    conv, state = _Into.apply(conv, acc[i][0], anchor), _Into.apply(state, acc[i][1], anchor)
                self._initial[i] = (conv, state)
        self.captured: dict[int, list[torch.Tensor | None]] = {i: [None, None] for i in recurrent}
        self.cut: torch.Tensor | None = None

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # the layer then always concatenates through `update_conv_state`, never updates in place

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        got = self._initial.get(layer_idx)
        return None if got is None else got[0].expand(self.rows, *got[0].shape[1:])

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        got = self._initial.get(layer_idx)
        return None if got is None else got[1].expand(self.rows, *got[1].shape[1:])

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """The layer's inputs `[B, C, T]` behind the resident window; records each row's window before its cut."""
        kernel = int(kwargs.get("conv_kernel_size") or 0)
        prev = self.get_conv_state(layer_idx)
        if prev is None:
            prev = conv_states.new_zeros((*conv_states.shape[:-1], kernel - 1))
        full = torch.cat([prev.to(conv_states.dtype), conv_states], dim=-1)  # [B, C, kernel - 1 + T]
        assert self.cut is not None
        idx = self.cut[:, None] + torch.arange(kernel - 1, device=full.device)[None, :]  # [B, kernel - 1]
        window = full.gather(-1, idx[:, None, :].expand(-1, full.shape[1], -1))  # [B, C, kernel - 1]
        self.captured[layer_idx][0] = window
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.captured[layer_idx][1] = recurrent_states
        return recurrent_states

    def states(self, layer_idx: int) -> LayerKV:
        conv, state = self.captured[layer_idx]
        if conv is None or state is None:
            raise RuntimeError(f"recurrent layer {layer_idx} recorded no state in this forward")
        return conv, state

    def _kv_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, DynamicLayer)]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        kv = self._kv_layers()
        return super().get_seq_length(kv[0]) if kv else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:  # type: ignore[override]
        if not self._kv_layers():  # only recurrent layers: nothing attends, the mask goes unused
            return query_length, 0
        return super().get_mask_sizes(query_length, layer_idx)  # type: ignore[no-any-return]


@contextmanager
def capturing(model: nn.Module, cache: EngineCache, lengths: torch.Tensor) -> Iterator[None]:
    """While the block lasts, `model`'s recurrent layers take their state from `cache` and record it before
    each row's last real token (`lengths - 1`, `[B]`)."""
    for module in mixers(model).values():
        _install(module)
    cache.cut = (lengths - 1).clamp_min(0)
    token = _CAPTURE.set(_Capture(cache.cut))
    try:
        yield
    finally:
        _CAPTURE.reset(token)
