"""Resident state of recurrent layers: (conv state, recurrent state) before a unit's last token.

Why: a Gated DeltaNet layer (Qwen3.5, Qwen3-Next, OLMo hybrid) or a Mamba layer (Mamba, Falcon-Mamba,
Jamba) carries no per-token KV. What its later tokens read of the earlier ones is two constant-size
tensors: the last `kernel - 1` inputs of its causal depthwise convolution (`[1, C, kernel - 1]`) and its
recurrent state (the delta rule's `[1, H_v, D_k, D_v]` in float32, as the model's own kernel computes it,
or Mamba's `[1, I, N]`). Those two are that layer's resident object; they sit in a unit's per-layer entry
where an attention layer keeps `(keys, values)`, and everything that stores, evicts, offloads or
accumulates G on resident KV handles them the same way. A hybrid layer (Zamba, Zamba 2, Falcon-H1:
attention and a Mamba or Mamba-2 mixer in one layer) keeps both, as one
`treetrain.models.layer_entry.HybridEntry`: its KV, read from every piece of the path like any attention
layer's, and its state, read from the last piece; G accumulates into both parts.

Two things differ from KV, and this module does both:

- **Where the state is taken.** Each unit's children are fed the parent's last token again (the overlap),
  so the state a child continues is the one *before* the parent's last token, and it is taken per row of
  a right-padded batch. The model's own forward runs unchanged, with two seams: an `EngineCache` answers
  the layer's `get_conv_state` / `update_conv_state` / `get_recurrent_state` / `update_recurrent_state`
  (the resident state in, the captured state out, never written in place), and the layer's own sequence
  and step functions, looked up in the layer's module by name, run their captured form while a capture
  is active (`treetrain.models.recurrent_kinds`: what each kind does to stop its state at a row's cut).
  The module's functions are patched once for the process, and outside a capture call the originals
  unchanged (`_install`).
- **How a path reads it.** Attention concatenates the KV of every unit on the path; a recurrent layer
  reads only the last unit's state. Its gradient goes into that unit's G accumulator (`_Into`), and the
  unit's closing backward adds <state, G> like <KV, G>.

Example:
    >>> from treetrain.models.presets import tiny_model
    >>> sorted(recurrent_layers(tiny_model("qwen3_5_text", 64)))
    [0, 2]
    >>> zamba2 = tiny_model("zamba2", 64)
    >>> sorted(recurrent_layers(zamba2)), sorted(hybrid_layers(zamba2)), sorted(unkeyed_layers(zamba2))
    ([0, 1, 2, 3], [1, 3], [0, 2])
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer

from treetrain.models.foreign_state import state_argument
from treetrain.models.layer_entry import LayerKV, state_part
from treetrain.models.past_routes import _Into
from treetrain.models.recurrent_kinds import CAPTURE, KINDS, NO_KIND, WKV, Capture, Kind, kind_of
from treetrain.models.shared_past import SharedPast

#: Layer types of transformers' configs whose layer carries recurrent state instead of KV.
RECURRENT_LAYER_TYPES = frozenset({"linear_attention"})
#: Layer types whose layer attends and runs a recurrent mixer, so it carries KV *and* recurrent state (a
#: `treetrain.models.layer_entry.HybridEntry`): Zamba's and Zamba 2's shared transformer block before a
#: Mamba / Mamba-2 mixer, Falcon-H1's attention beside a Mamba-2 mixer; `hybrid_sliding` with a windowed
#: attention (whose window the support check probes like any sliding layer's).
HYBRID_LAYER_TYPES = frozenset({"hybrid", "hybrid_sliding"})
#: Layer types that keep no state at all (an MLP or experts block in the layer list, as in Nemotron-H).
STATELESS_LAYER_TYPES = frozenset({"mlp", "moe"})


def _layer_types(model: nn.Module) -> list[str]:
    """The config's `layer_types`, read as the model builds them: a layer whose block holds a recurrent
    mixer of a known kind is a recurrent layer whatever its declared name (Zamba and Zamba 2 build a Mamba
    block for every type but 'hybrid', 'full_attention' included), so the engine never expects KV from a
    layer that keeps none. For a model that passes its state as a forward argument the engine fills (RWKV:
    `treetrain.models.rwkv_state`), every layer with a WKV mixer is a recurrent one."""
    config = model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]
    declared = list(getattr(config, "layer_types", None) or [])
    if declared:
        built = _built_mixers(model)
        stateful = RECURRENT_LAYER_TYPES | HYBRID_LAYER_TYPES
        return ["linear_attention" if i in built and t not in stateful else t for i, t in enumerate(declared)]
    found = argument_state_mixers(model)
    return (
        ["linear_attention" if i in found else "full_attention" for i in range(max(found) + 1)]
        if found
        else []
    )


_BUILT: weakref.WeakKeyDictionary[nn.Module, frozenset[int]] = weakref.WeakKeyDictionary()


def _built_mixers(model: nn.Module) -> frozenset[int]:
    """Layer indices of the model's modules that are recurrent mixers of a known kind, found once per model
    (its modules do not change after it is built; every forward asks)."""
    found = _BUILT.get(model)
    if found is None:
        indices = (
            getattr(m, "layer_idx", getattr(m, "layer_id", None)) for m in model.modules() if kind_of(m)
        )
        found = frozenset(i for i in indices if isinstance(i, int) and i >= 0)
        _BUILT[model] = found
    return found


def argument_state_mixers(model: nn.Module) -> dict[int, Any]:
    """RWKV's time-mixing modules by layer, when the model passes their state through its forward's list
    argument (`state_argument`), else empty."""
    if state_argument(model) is None:
        return {}
    found: Iterator[Any] = (m for m in model.modules() if getattr(kind_of(m), "name", None) == WKV.name)
    return {int(m.layer_id): m for m in found}


def recurrent_layers(model: nn.Module) -> frozenset[int]:
    """Indices of the decoder layers that carry recurrent state (config `layer_types`: recurrent and hybrid
    layers), empty for KV models."""
    wanted = RECURRENT_LAYER_TYPES | HYBRID_LAYER_TYPES
    return frozenset(i for i, t in enumerate(_layer_types(model)) if t in wanted)


def hybrid_layers(model: nn.Module) -> frozenset[int]:
    """Indices of the decoder layers that carry KV and recurrent state together (layer type 'hybrid')."""
    return frozenset(i for i, t in enumerate(_layer_types(model)) if t in HYBRID_LAYER_TYPES)


def mixer_after_attention(model: nn.Module, blocks: nn.ModuleList) -> frozenset[int]:
    """Hybrid layers whose recurrent mixer reads the layer's attention output (Zamba's and Zamba 2's: a shared
    transformer block, then a Mamba decoder over its output), unlike Falcon-H1's, whose mixer reads the
    layer's input beside its attention. A gradient into such a layer's resident state runs back through its
    attention even in a forward without loss targets. `blocks` are the model's decoder blocks
    (`treetrain.models.decoder.decoder_layers`)."""
    return frozenset(
        i for i in hybrid_layers(model) if i < len(blocks) and hasattr(blocks[i], "mamba_decoder")
    )


def stateless_layers(model: nn.Module) -> frozenset[int]:
    """Indices of the decoder layers that keep no state (config `layer_types` 'mlp' or 'moe')."""
    return frozenset(i for i, t in enumerate(_layer_types(model)) if t in STATELESS_LAYER_TYPES)


def continues_with_overlap(model: nn.Module) -> bool:
    """Whether a unit continues its parent by feeding the parent's last token again (the overlap): any
    layer's state is taken before a unit's last token, a recurrent layer's or the recurrent half of a hybrid
    layer's. A model of hybrid layers only (Falcon-H1) has no layer in `unkeyed_layers` and still needs it:
    without the overlap its Mamba-2 state would skip the parent's last token."""
    return bool(recurrent_layers(model))


def unkeyed_layers(model: nn.Module) -> frozenset[int]:
    """Layers without per-token KV: recurrent ones (their state has no sequence axis) and stateless ones
    (an empty entry). A hybrid layer has KV, so it is not one of them."""
    return (recurrent_layers(model) - hybrid_layers(model)) | stateless_layers(model)


def mixers(model: nn.Module) -> dict[int, tuple[Any, Kind]]:
    """The mixer module of each recurrent layer and its kind, by layer index (layers whose module is of no
    known kind are missing: `unsupported_mixer` names them)."""
    wanted = recurrent_layers(model)
    found: dict[int, tuple[Any, Kind]] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", getattr(module, "layer_id", None))  # RWKV names it `layer_id`
        kind = kind_of(module) if idx in wanted else None
        if kind is not None:
            found[int(idx)] = (module, kind)  # type: ignore[arg-type]
    return found


def unsupported_mixer(model: nn.Module) -> str | None:
    """Why the recurrent layers cannot carry resident state, or None when every one can."""
    wanted = recurrent_layers(model)
    if not wanted:
        return None
    missing = sorted(wanted - set(mixers(model)))
    if not missing:
        return None
    kinds = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if getattr(m, "layer_idx", None) in missing and not type(m).__name__.endswith(("Layer", "Block"))
        }
    )
    found_kinds = ", ".join(kinds) or "modules without a layer index"
    if kinds and all(k in NO_KIND for k in kinds):  # what exactly each lacks, first: the message is cut short
        lacks = "; ".join(NO_KIND[k] if len(kinds) == 1 else f"{k}: {NO_KIND[k]}" for k in kinds)
        return (
            f"its recurrent layers {missing} ({found_kinds}) are of no kind whose state the engine keeps "
            f"resident: {lacks}"
        )
    known = "; ".join(f"{k.name} ({' / '.join(k.functions)})" for k in KINDS)
    types = sorted({_layer_types(model)[i] for i in missing})
    return (
        f"its recurrent layers {missing} (layer type {' / '.join(map(repr, types))}: {found_kinds}) are of no kind whose "
        f"state the engine keeps resident; it keeps (conv state, recurrent state) for layers calling {known}"
    )


def state_bytes_per_unit(model: nn.Module) -> int:
    """Bytes of one unit's recurrent state over all recurrent layers (each kind's conv window and state, in
    the dtypes the layer's own code keeps them)."""
    size = next(model.parameters()).element_size()
    return sum(kind.state_bytes(module, size) for module, kind in mixers(model).values())


_ORIGINAL: dict[tuple[str, str], Callable[..., Any]] = {}


def _dispatch(original: Callable[..., Any], captured: Callable[..., Any]) -> Callable[..., Any]:
    """The layer module's function: `captured` while a capture is active, else `original`."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return (original if CAPTURE.get() is None else captured)(*args, **kwargs)

    call._treetrain_dispatch = True  # type: ignore[attr-defined]
    call.__wrapped__ = original  # type: ignore[attr-defined]  # inspect.signature gives the original's
    return call


def _install(module: nn.Module, kind: Kind) -> None:
    """Route the layer module's functions of `kind` through `_dispatch`, for the whole process.

    Process-wide on purpose, and never undone: outside a capture the dispatch calls transformers' own
    function with the same arguments, so a patched module computes exactly what an unpatched one does
    (tests/models/test_recurrent_install.py checks it bit for bit), and undoing it after a use would race
    with a capture running in another thread. Installing is idempotent: the originals are kept once per
    module (`_ORIGINAL`), and a function already routed is left as it is, so a second install changes
    nothing."""
    mod = sys.modules[type(module).__module__]
    seq, single = kind.functions
    for name in kind.functions:
        if (mod.__name__, name) not in _ORIGINAL:
            _ORIGINAL[(mod.__name__, name)] = getattr(mod, name)
    original_seq, original_step = _ORIGINAL[(mod.__name__, seq)], _ORIGINAL[(mod.__name__, single)]
    if not getattr(getattr(mod, seq), "_treetrain_dispatch", False):
        setattr(mod, seq, _dispatch(original_seq, kind.captured(original_seq, original_step)))
    if not getattr(getattr(mod, single), "_treetrain_dispatch", False):
        step = kind.captured_step(original_step) if kind.captured_step is not None else original_step
        setattr(mod, single, _dispatch(original_step, step))


class EngineCache(DynamicCache):
    """A `DynamicCache` whose recurrent layers read their state from a resident past and record, per row,
    the state before each row's last real token (`captured`), instead of holding state of their own.
    A hybrid layer (in `recurrent` and in `hybrid`) also keeps KV, in a `DynamicLayer` at its index."""

    def __init__(
        self,
        n_layers: int,
        recurrent: frozenset[int],
        past: SharedPast | None,
        rows: int,
        anchor: torch.Tensor | None,
        stateless: frozenset[int] = frozenset(),
        hybrid: frozenset[int] = frozenset(),
    ) -> None:
        unkeyed = (recurrent - hybrid) | stateless
        layers: list[Any] = [DummyLayer() if i in unkeyed else DynamicLayer() for i in range(n_layers)]
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
                conv, state = state_part(last[i])
                if acc is not None and anchor is not None and anchor.requires_grad:
                    g_conv, g_state = state_part(acc[i])
                    conv, state = _Into.apply(conv, g_conv, anchor), _Into.apply(state, g_state, anchor)
                self._initial[i] = (conv, state)
        self.captured: dict[int, list[torch.Tensor | None]] = {i: [None, None] for i in recurrent}
        self.cut: torch.Tensor | None = None
        self._current: int | None = None
        self._head = 0
        self.attending: int | None = None
        """The cache index of the KV last written: the layer whose attention runs now (Zamba 2's shared
        block is one module for several layers, so its own `layer_idx` does not say which)."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.attending = layer_idx
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)  # type: ignore[no-any-return]

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # the layer then always concatenates through `update_conv_state`, never updates in place

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        got = self._initial.get(layer_idx)
        return None if got is None else got[0].expand(self.rows, *got[0].shape[1:])

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._current = layer_idx  # a layer reads its state first: the captured functions read it back
        self._head = 0
        return self._initial_state(layer_idx)

    def _initial_state(self, layer_idx: int) -> torch.Tensor | None:
        got = self._initial.get(layer_idx)
        return None if got is None else got[1].expand(self.rows, *got[1].shape[1:])

    def current_state(self) -> torch.Tensor | None:
        """The initial recurrent state of the layer now running (`[B, ...]`), None at the root."""
        return None if self._current is None else self._initial_state(self._current)

    def next_head(self) -> int:
        head, self._head = self._head, self._head + 1
        return head

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
        if state is None and self.cut is not None and not bool(self.cut.any()):
            state = self._initial_state(layer_idx)  # one-token rows: the state before it is the initial one
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


def attending_layer() -> int | None:
    """The cache index of the attention layer running now, inside a capture (None outside one)."""
    active = CAPTURE.get()
    source = None if active is None else active.source
    return source.attending if isinstance(source, EngineCache) else None


@contextmanager
def capturing(model: nn.Module, cache: EngineCache, lengths: torch.Tensor) -> Iterator[None]:
    """While the block lasts, `model`'s recurrent layers take their state from `cache` and record it before
    each row's last real token (`lengths - 1`, `[B]`)."""
    for module, kind in mixers(model).values():
        _install(module, kind)
    cache.cut = (lengths - 1).clamp_min(0)
    token = CAPTURE.set(Capture(cache.cut, cache))
    try:
        yield
    finally:
        CAPTURE.reset(token)
