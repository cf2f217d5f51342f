"""Recurrent state kept where the engine cannot reach it: why such a model is refused, found from the model.

Why: the engine hands a recurrent layer its resident state, and takes that state back before each row's
cut, through one object only: the transformers `Cache` it passes to the forward
(`treetrain.models.recurrent_state.EngineCache`, answering `get_recurrent_state` / `update_conv_state` and
the like per layer index). A model that keeps its state anywhere else gives the engine nothing to hand the
shared prefix's state to, and nothing to read a node's state from. Three such places exist, and each
needs a different seam before the model could be accepted, so the refusal names which one this model uses:

- **A forward argument that is not a Cache** (RWKV's `state`: a list of tensors, one per kind of state,
  each covering every layer, read and written by the blocks themselves), found from the forward's type
  hints: an argument of list-of-tensors type that the output returns again under the same name.
- **Its own cache class** (xLSTM's `xLSTMCache`, whose per-layer `rnn_state` tuples the forward copies into
  in place), found the same way: an argument whose type is a class of the model's own module that is not
  a transformers `Cache`.
- **Its own modules** (RecurrentGemma's recurrent blocks set their conv and RG-LRU state as plain module
  attributes, ignoring the cache the caller passes), found by behaviour: a forward with a fresh cache
  leaves per-row tensors (first axis the batch) on modules, outside their parameters and buffers. The
  attributes the forward added or replaced are put back afterwards; writes into existing tensors, or a
  forward that edits its own weights in eval mode, would not be undone, which is why the support check
  runs this forward only for a model it refuses anyway, to give the true reason.

The checks look at structure and behaviour, never at the model type, so another model built the same way
gets the same reason.

Example:
    >>> from treetrain.models.presets import tiny_model
    >>> forward_state_reason(tiny_model("llama", 64)) is None    # its state is a Cache
    True
    >>> module_state_reason(tiny_model("qwen3_5_text", 64)) is None  # recurrent state in the Cache
    True
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch import nn
from transformers import Cache, DynamicCache

from treetrain.models.module_modes import evaluating

#: How the engine passes resident state, and so what each refusal says the model would need.
_ENGINE = (
    "the engine passes resident state in and out only through the Cache it gives the forward (`EngineCache`, "
    "per layer index)"
)
_PROBE_ROWS = 3  # a batch size no cached constant is likely to share, so per-row state stands out


def _members(hint: Any) -> tuple[Any, ...]:
    """The types of a union hint (`X | None` -> (X, NoneType)), or the hint itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _is_tensor_type(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, torch.Tensor)


def _tensor_sequence(hint: Any) -> bool:
    """`list[Tensor]`, `tuple[Tensor, ...]` or the like: tensors in a flat sequence (not nested KV tuples)."""
    if typing.get_origin(hint) not in (list, tuple):
        return False
    args = [a for a in typing.get_args(hint) if a is not Ellipsis]
    return bool(args) and all(_is_tensor_type(a) for a in args)


def _own_state_class(hint: Any, module_name: str) -> bool:
    """A class from the model's own module that is not a transformers Cache nor a tensor."""
    return (
        isinstance(hint, type)
        and hint.__module__ == module_name
        and not issubclass(hint, (Cache, torch.Tensor, nn.Module))
    )


def _output_fields(hints: dict[str, Any]) -> set[str]:
    """Field names of the dataclass outputs the forward declares it returns."""
    names: set[str] = set()
    for member in _members(hints.get("return")):
        if isinstance(member, type) and is_dataclass(member):
            names.update(f.name for f in fields(member))
    return names


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls.forward)  # type: ignore[attr-defined]
    except Exception:  # hints that do not resolve say nothing either way
        return {}


RoundTrip = tuple[tuple[str, tuple[Any, ...]], ...]
_ROUND_TRIPS: dict[type, RoundTrip] = {}


def _round_trip(cls: type) -> RoundTrip:
    """The forward's arguments that its output returns again under the same name, with their types, where
    none of those types is a transformers Cache."""
    if cls in _ROUND_TRIPS:
        return _ROUND_TRIPS[cls]
    hints = _hints(cls)
    returned = _output_fields(hints)
    found = []
    for name in inspect.signature(cls.forward).parameters:  # type: ignore[attr-defined]
        if name not in hints or name not in returned:
            continue
        members = tuple(m for m in _members(hints[name]) if m is not type(None))
        if not any(isinstance(m, type) and issubclass(m, Cache) for m in members):
            found.append((name, members))
    _ROUND_TRIPS[cls] = tuple(found)
    return _ROUND_TRIPS[cls]


def state_argument(model: nn.Module) -> str | None:
    """The forward argument through which the model passes its recurrent state as a list of tensors (RWKV's
    `state`), or None."""
    return next((n for n, members in _round_trip(type(model)) if any(map(_tensor_sequence, members))), None)


def forward_state_reason(model: nn.Module, *, supplied: str | None = None) -> str | None:
    """Why the forward carries recurrent state past the engine's Cache (an argument it returns again that
    is a list of tensors, or a class of its own that is not a Cache), or None. `supplied`: a list-of-tensors
    state argument the engine fills itself (`treetrain.models.rwkv_state`)."""
    module_name = type(model).__module__
    for name, members in _round_trip(type(model)):
        if name == supplied:
            continue
        if any(_tensor_sequence(m) for m in members):
            return (
                f"keeps its recurrent state in the `{name}` argument of its forward (a list of tensors, returned "
                f"again as `{name}`), not in a Cache; {_ENGINE}, so it would need that state kept per layer in "
                "such a cache"
            )
        own = next((m for m in members if _own_state_class(m, module_name)), None)
        if own is not None:
            return (
                f"keeps its recurrent state in its own `{own.__name__}` (the `{name}` argument of its forward, "
                f"returned again as `{name}`), which is not a transformers Cache; {_ENGINE}, so it would need "
                "that state kept per layer in such a cache"
            )
    return None


def _held(model: nn.Module) -> dict[tuple[str, str], Any]:
    """Every plain attribute of every module (parameters and buffers live in their own dicts)."""
    return {
        (name, key): value for name, module in model.named_modules() for key, value in vars(module).items()
    }


@torch.no_grad()
def module_state_reason(model: nn.Module) -> str | None:
    """Why the model keeps per-row state on its modules instead of in the cache it is given, or None.

    One short forward with a fresh `DynamicCache`; a forward that fails finds nothing (the split probe,
    which runs under the support check's guard, reports failures)."""
    params = inspect.signature(type(model).forward).parameters
    cache_arg = next((c for c in ("cache", "past_key_values") if c in params), None)
    if cache_arg is None:
        return None
    try:
        device = next(model.parameters()).device
        vocab = int(model.config.get_text_config(decoder=True).vocab_size)  # type: ignore[union-attr,operator]
    except (StopIteration, AttributeError, TypeError, ValueError):  # nothing to run it with: nothing found
        return None
    ids = torch.arange(4 * _PROBE_ROWS, device=device).view(_PROBE_ROWS, 4) % vocab  # [3, 4]
    kwargs: dict[str, Any] = {cache_arg: DynamicCache(), "use_cache": True}
    if "position_ids" in params:
        kwargs["position_ids"] = torch.arange(4, device=device)[None].expand(_PROBE_ROWS, -1)
    before = _held(model)
    try:
        with evaluating(model):
            model(input_ids=ids, **kwargs)
    except Exception:
        return None
    finally:
        after = _held(model)
        modules = dict(model.named_modules())
        for (name, key), value in after.items():
            if (name, key) not in before:
                delattr(modules[name], key)
            elif before[(name, key)] is not value:
                setattr(modules[name], key, before[(name, key)])
    found = sorted(
        {
            f"{type(modules[name]).__name__}.{key}"
            for (name, key), value in after.items()
            if isinstance(value, torch.Tensor)
            and value.dim() > 0
            and value.shape[0] == _PROBE_ROWS
            and ((name, key) not in before or before[(name, key)] is not value)
        }
    )
    if not found:
        return None
    return (
        f"keeps its recurrent state on its own modules ({', '.join(found)}, set by its forward), not in the "
        f"cache the caller passes; {_ENGINE}, so it would need that state kept per layer in that cache"
    )
