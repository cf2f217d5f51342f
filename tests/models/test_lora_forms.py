"""The same LoRA adapters as a `PeftModel` and injected into the model give the same `exact` gradient, equal
to the flat reference within FACTOR times the noise floor measured in the same case, for every family the
LoRA tests cover and Gemma 3n.

Each model is handed over as `from_pretrained` gives it: in eval mode, with attention dropout in its config.
PEFT's wrapper keeps a train-mode flag of its own, so a check that restores "the model's mode" from that
flag puts the model inside into train mode: dropout then draws masks, and Gemma 3n's AltUp computes
something else. The support gate must leave every module's mode as it found it (`treetrain.models.module_modes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from support.lora_cases import GEMMA3N, OTHER_FAMILY, form_factory
from support.replay_cases import SHAPES, make_batch

import treetrain.models.support_probes as support_probes
from treetrain.loss.loss_config import LossConfig
from treetrain.models.presets import FAMILIES
from treetrain.replay import ReplayConfig
from treetrain.replay.verify import deviation, flat_gradient, noise_floor, tree_gradient

FACTOR = 5.0
LOSS = LossConfig()
REPLAY = ReplayConfig(contract="exact", microbatch=2, chunk_size=5)
DTYPE = torch.float64


def _exact_and_flat(
    family: str, form: str, *, same_modes: bool = True
) -> tuple[torch.Tensor, torch.Tensor, float, slice]:
    """The tree gradient, the flat one, the noise floor, and where the first adapter matrix sits in them.
    With `same_modes`, the replay must leave every module in the mode it found it in."""
    make = form_factory(family, form, DTYPE)
    batch = make_batch(SHAPES["multi_level"](0), LOSS)
    floor = noise_floor(make, batch, LOSS)
    flat = flat_gradient(make(), batch, LOSS)
    model = make()
    modes = [m.training for m in model.modules()]
    tree = tree_gradient(model, batch, LOSS, REPLAY)
    assert not same_modes or [m.training for m in model.modules()] == modes
    start = 0
    for name, p in model.named_parameters():
        if ".lora_A." in name:
            return tree, flat, floor, slice(start, start + p.numel())
        start += p.numel()
    raise AssertionError(f"{family} {form}: no adapter")


@pytest.mark.parametrize("family", [*FAMILIES, OTHER_FAMILY, pytest.param(GEMMA3N, marks=pytest.mark.slow)])
def test_peft_model_and_injected_adapters_match_flat(family: str) -> None:
    """Both forms equal flat, and each other. Negative control: the PeftModel's first adapter left without
    its gradient is caught far above the bound."""
    tree, flat, floor, first = _exact_and_flat(family, "peft_model")
    bound = FACTOR * floor
    dev = deviation(tree, flat).abs
    assert float(flat.norm()) > 0 and dev <= bound, f"{family} PeftModel: {dev:.3e} > {FACTOR} x {floor:.3e}"
    injected, flat_injected, floor_injected, _ = _exact_and_flat(family, "injected")
    dev_injected = deviation(injected, flat_injected).abs
    assert dev_injected <= FACTOR * floor_injected, f"{family} injected: {dev_injected:.3e}"
    assert deviation(tree, injected).abs <= bound  # the same adapters, the same update
    dropped = tree.clone()
    dropped[first] = 0
    assert deviation(dropped, flat).abs > 100 * bound, f"{family}: a missing adapter gradient went unseen"


@contextlib.contextmanager
def _restoring_the_wrapper_flag(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The idiom the gate must not use: eval, then every module set to the top module's `training` flag."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def test_negative_control_a_gate_that_restores_the_wrapper_flag_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the probes restoring the wrapper's flag, the PeftModel leaves the gate in train mode. Gemma 3n
    without dropout: its train-mode AltUp (clamped coefficients, the `correction_coefs` adapter bypassed)
    moves the gradient far from flat, silently."""
    monkeypatch.setattr(support_probes, "evaluating", _restoring_the_wrapper_flag)
    batch = make_batch(SHAPES["multi_level"](0), LOSS)
    make = form_factory(GEMMA3N, "peft_model", DTYPE, dropout=0.0)
    floor = noise_floor(make, batch, LOSS)
    dev = deviation(tree_gradient(make(), batch, LOSS, REPLAY), flat_gradient(make(), batch, LOSS)).abs
    assert dev > 100 * FACTOR * floor, (dev, floor)


def test_negative_control_the_wrapper_flag_with_attention_dropout_stops_the_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Llama with attention dropout in its config: left in train mode by that gate, its attention passes
    dropout to shared-past attention, which refuses it rather than compute another function."""
    monkeypatch.setattr(support_probes, "evaluating", _restoring_the_wrapper_flag)
    batch = make_batch(SHAPES["multi_level"](0), LOSS)
    with pytest.raises(RuntimeError, match=r"passes \['dropout'\] to its attention"):
        tree_gradient(form_factory("llama", "peft_model", DTYPE)(), batch, LOSS, REPLAY)
    tree_gradient(form_factory("llama", "injected", DTYPE)(), batch, LOSS, REPLAY)
