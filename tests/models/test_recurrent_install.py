"""The recurrent kinds' patches of transformers' modules are process-wide and idempotent
(`treetrain.models.recurrent_state._install`): installing twice changes nothing, and outside a capture the
patched function computes exactly what the original does, so the process never needs them undone."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from treetrain.models.presets import tiny_model
from treetrain.models.recurrent_kinds import Kind
from treetrain.models.recurrent_state import _dispatch, _install, mixers


def _depth(fn: Callable[..., Any]) -> int:
    """How many treetrain dispatches wrap `fn` (1 when installed once, 0 when not installed)."""
    n = 0
    while getattr(fn, "_treetrain_dispatch", False):
        n, fn = n + 1, fn.__wrapped__  # type: ignore[attr-defined]
    return n


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 13)[None]
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def installed() -> tuple[torch.nn.Module, Any, Kind]:
    model = tiny_model("qwen3_5_text", 64, dtype=torch.float64)
    module, kind = next(iter(mixers(model).values()))
    _install(module, kind)
    return model, module, kind


def test_installing_twice_changes_nothing(installed) -> None:
    _, module, kind = installed
    mod = sys.modules[type(module).__module__]
    first = [getattr(mod, name) for name in kind.functions]
    _install(module, kind)
    assert [getattr(mod, name) for name in kind.functions] == first  # the very same function objects
    assert [_depth(f) for f in first] == [1, 1]


def test_outside_a_capture_the_patched_functions_are_the_originals(installed, monkeypatch) -> None:
    """The model's forward with the patches in place equals, bit for bit, its forward with transformers'
    own functions put back."""
    model, module, kind = installed
    mod = sys.modules[type(module).__module__]
    patched = _logits(model)
    for name in kind.functions:
        monkeypatch.setattr(mod, name, getattr(mod, name).__wrapped__)
    assert _depth(getattr(mod, kind.functions[0])) == 0
    assert torch.equal(patched, _logits(model))


def test_the_checks_catch_a_second_wrap_and_a_changed_function(installed, monkeypatch) -> None:
    """Negative controls: wrapping the dispatch again is seen as depth 2, and a sequence form that changes
    its output (by one part in 10^6) changes the logits the equality above compares."""
    model, module, kind = installed
    mod = sys.modules[type(module).__module__]
    seq = getattr(mod, kind.functions[0])
    assert _depth(_dispatch(seq, seq)) == 2
    original = seq.__wrapped__

    def off(*args: Any, **kwargs: Any) -> Any:
        out, state = original(*args, **kwargs)
        return out * (1 + 1e-6), state

    before = _logits(model)
    monkeypatch.setattr(mod, kind.functions[0], off)
    assert not torch.equal(before, _logits(model))
