"""One forward of the model as it is, watched: which decoder blocks run how often, and which dropout runs.

The support check judges what the model does, not what its config or a wrapper's flag says
(`treetrain.models.support`). A config field such as GPT-NeoX's `classifier_dropout` belongs to another head
and never runs in the causal LM; a PEFT wrapper's `training` flag need not match the modules inside it
(`treetrain.models.module_modes`). So the forward records:

- every `nn.Dropout` (any of torch's dropout modules) that runs with p > 0 in train mode, named as in the
  unwrapped model, so a `PeftModel` and the same adapters injected into the model name the same module
  (LoRA's own `lora_dropout` is one of them);
- the attention dropout each attention layer hands its attention function (`dropout=` of transformers'
  attention interface, looked up through `ALL_ATTENTION_FUNCTIONS.get_interface`);
- how many times each decoder block runs: a block that runs more often than the stack lists it is a looped
  transformer (Dory), whatever its cache does, so that reason is known before any probe splits a sequence.

Dropout read as a function from a config field (Starcoder2's `residual_dropout`) goes through neither; the
support check's second run of the same tokens catches it by its effect, and `dropout_fields` names the
config fields that may be the cause.

Example:
    >>> import torch
    >>> from treetrain.models.presets import tiny_model
    >>> model = tiny_model("llama", vocab_size=64).train()
    >>> ids = torch.arange(1, 9)[None]
    >>> seen = observe_forward(model, ids, torch.arange(8)[None])
    >>> seen.dropout is None, seen.looped, tuple(seen.logits.shape)
    (True, None, (1, 8, 64))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from treetrain.models.decoder import decoder_layers
from treetrain.models.lora import unwrap

#: torch's dropout modules (each draws a mask in train mode when p > 0).
DROPOUT_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


@dataclass(frozen=True)
class ObservedForward:
    """What one forward of the model in its current modes did."""

    logits: torch.Tensor
    """The model's own logits, `[1, T, V]`."""
    dropout: str | None
    """The first dropout that drew a mask (a module and its p, or an attention layer's attention dropout)."""
    looped: tuple[int, int] | None
    """(block index, times it ran) of the first decoder block that ran more often than the stack lists it."""


@dataclass
class _Seen:
    modules: list[str] = field(default_factory=list)
    attention: list[tuple[str, float]] = field(default_factory=list)
    calls: dict[int, int] = field(default_factory=dict)


@contextlib.contextmanager
def _attention_dropout(names: dict[int, str], seen: _Seen) -> Iterator[None]:
    """Record the `dropout` each attention layer passes to the function transformers' interface gives it."""
    own = vars(ALL_ATTENTION_FUNCTIONS).get("get_interface")  # set on the instance by someone else, or None
    original = ALL_ATTENTION_FUNCTIONS.get_interface

    def get_interface(implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
        function = original(implementation, default)

        def recording(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            p = kwargs.get("dropout")
            if isinstance(p, (int, float)) and p > 0:
                seen.attention.append((names.get(id(module), type(module).__name__), float(p)))
            return function(module, *args, **kwargs)

        return recording

    ALL_ATTENTION_FUNCTIONS.get_interface = get_interface  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del ALL_ATTENTION_FUNCTIONS.get_interface  # the class's method again
        else:
            ALL_ATTENTION_FUNCTIONS.get_interface = own  # type: ignore[method-assign]


@torch.no_grad()
def observe_forward(model: PreTrainedModel, ids: torch.Tensor, positions: torch.Tensor) -> ObservedForward:
    """Run `model(ids)` (`[1, T]`, no cache) in the modes its modules are in, recording what `ObservedForward`
    holds. The caller keeps the random state (`torch.random.fork_rng`) if the forward may draw."""
    inner = unwrap(model)
    names = {id(m): name for name, m in inner.named_modules()}
    seen = _Seen()
    blocks = list(decoder_layers(model))
    listed = {id(b): sum(1 for other in blocks if other is b) for b in blocks}
    hooks: list[torch.utils.hooks.RemovableHandle] = []
    try:
        for name, module in inner.named_modules():
            if isinstance(module, DROPOUT_MODULES):

                def ran(mod: nn.Module, args: Any, name: str = name) -> None:
                    if mod.training and float(getattr(mod, "p", 0.0)) > 0:
                        seen.modules.append(f"{name} (p={mod.p:g})")

                hooks.append(module.register_forward_pre_hook(ran))
        for index, block in enumerate(blocks):
            if blocks.index(block) != index:
                continue  # listed twice: counted at its first place

            def called(mod: nn.Module, args: Any, index: int = index) -> None:
                seen.calls[index] = seen.calls.get(index, 0) + 1

            hooks.append(block.register_forward_pre_hook(called))
        with _attention_dropout(names, seen):
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits  # [1, T, V]
    finally:
        for hook in hooks:
            hook.remove()
    looped = next(
        ((i, n) for i, n in sorted(seen.calls.items()) if n > listed[id(blocks[i])]),
        None,
    )
    if seen.modules:
        dropout: str | None = seen.modules[0]
    elif seen.attention:
        where, p = seen.attention[0]
        same = {k: v for k, v in dropout_fields(inner).items() if v == p}
        named = {k: v for k, v in same.items() if "att" in k} or same  # an attention field first
        hint = ", ".join(f"config.{k}={v:g}" for k, v in named.items())
        dropout = f"attention dropout {p:g} passed to the attention function by {where}" + (
            f"; {hint}" if hint else ""
        )
    else:
        dropout = None
    return ObservedForward(logits, dropout, looped)


def dropout_fields(model: nn.Module) -> dict[str, float]:
    """The text config's fields named `*dropout*` or `*_pdrop` above 0: what functional dropout may read.
    A hint for a refusal found by behaviour, never a refusal on its own (another head may own the field)."""
    config = model.config.get_text_config(decoder=True)  # type: ignore[operator,union-attr]
    to_dict = getattr(config, "to_dict", None)
    fields: dict[str, object] = to_dict() if callable(to_dict) else {}
    return {
        key: float(value)
        for key, value in sorted(fields.items())
        if ("dropout" in key or key.endswith("_pdrop"))
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value > 0
    }
