"""`treetrain.train.prewarm`: a launch's calibrations measured once, where its ranks will read them."""

from __future__ import annotations

import pytest
import torch

from treetrain.loss.loss_config import LossConfig
from treetrain.memory import calibration_store
from treetrain.memory.calibrate import calibration_key
from treetrain.models.logprobs import DEFAULT_MAX_LOGIT_ELEMENTS
from treetrain.replay.schedule import CONTRACTS
from treetrain.train.config import load_config
from treetrain.train.models import load_models
from treetrain.train.prewarm import prewarm_calibrations


def test_both_contracts_are_stored_under_the_keys_a_cpu_rank_asks_for() -> None:
    """The planner prices flat (`response_only`'s calibration) against the tree, so both are stored, under
    the key a rank of a DeepSpeed launch on the CPU computes for its own model."""
    settings = ["model.path=demo", "distributed.backend=deepspeed"]
    assert prewarm_calibrations(settings)
    policy = load_models(load_config(None, settings).model).policy
    entropy = LossConfig().needs_entropy
    for contract in CONTRACTS:
        key = calibration_key(policy, contract, entropy, DEFAULT_MAX_LOGIT_ELEMENTS)
        assert calibration_store.load(key) is not None, contract


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_device_this_machine_lacks_measures_nothing() -> None:
    """`device: cuda` where torch sees none is the run's own one-line refusal to make, not a traceback here."""
    assert prewarm_calibrations(["model.path=demo", "device=cuda"]) is False


def test_settings_the_config_refuses_measure_nothing() -> None:
    assert prewarm_calibrations(["model.path=demo", "no_such_key=1"]) is False
    assert prewarm_calibrations(["model.path=demo", "model.lora.rank=4"]) is False
