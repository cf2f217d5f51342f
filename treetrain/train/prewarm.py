"""A run's memory calibrations, measured once before its ranks are launched.

Why: the first update of a run calibrates the memory ledger on the live model
(`treetrain.memory.calibrate`), once per model configuration, trainable parameters, dtype and machine, and
keeps the result in the calibration store. Under torchrun every rank of a fresh store measures it, and under
ZeRO-3 each probe gathers its parameters from the other ranks: about 45 s of a 2-rank run's first update on
two CPU cores. Measured here first, in one process, every rank reads it from the store instead. The tests'
torchrun launches and `bench/context_runs.py` do this, so that a launch times the update, not the probes.

Example (measures, or reads from the store, the calibrations of the embedded demo model):
    >>> prewarm_calibrations(["model.path=demo"])  # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from treetrain.errors import TreetrainError
from treetrain.memory.calibrate import calibrate
from treetrain.replay.schedule import CONTRACTS
from treetrain.train.config import load_config
from treetrain.train.device import place, train_device
from treetrain.train.models import load_models


def prewarm_calibrations(settings: Sequence[str]) -> bool:
    """Measure, in this process, the calibrations a `treetrain train --set SETTINGS` run's planner asks for
    (both contracts: the planner prices flat against tree), into the calibration store, on the device the
    run's ranks train on (a calibration is per device type and GPU model). False, with nothing measured,
    for settings whose model this cannot build as the trainer does (LoRA adapters) or that the config
    refuses (the run itself says what is wrong)."""
    try:
        config = load_config(None, list(settings))
        if config.model.lora is not None:
            return False
        on_cpu = config.distributed.backend == "deepspeed" and os.environ.get("DS_ACCELERATOR") == "cpu"
        device = train_device("cpu" if on_cpu else config.device)  # DeepSpeed's ranks: `auto`'s device
        policy = load_models(config.model).policy
    except TreetrainError:
        return False
    place(policy, device)
    loss, replay = config.policy_loss, config.replay
    for contract in CONTRACTS:
        calibrate(
            policy, contract, with_entropy=loss.needs_entropy, max_logit_elements=replay.max_logit_elements
        )
    return True
