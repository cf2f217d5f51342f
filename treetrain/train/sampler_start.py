"""The `hf` sampler's process, started as early as a run can start it.

An asynchronous run's `hf` engine samples in a process of its own, whose start-up is mostly imports
(`treetrain.rollout.engines.sampler_process`). `early_sampler(cfg)` spawns it at once when the run will
use it, so its imports overlap the trainer's own start (its imports, the model, the backend) instead of
delaying the first rollout. `treetrain train` calls it before it imports the trainer; `Trainer` calls it
itself when it was given none. This module imports nothing heavy: the command line calls it before torch
loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treetrain.rollout.engines.sampler_process import SamplerProcess

if TYPE_CHECKING:
    from treetrain.train.config import TrainConfig


def needs_sampler_process(cfg: TrainConfig) -> bool:
    """Whether the run samples in an `hf` sampler process: `rollout.max_staleness` >= 1 with the `hf` engine,
    growing its own rollouts (recorded trees have no sampler)."""
    r = cfg.rollout
    return r.max_staleness >= 1 and r.engine == "hf" and not r.trees


def early_sampler(cfg: TrainConfig) -> SamplerProcess | None:
    """A sampler process, spawned now, when the run will need one; else None."""
    return SamplerProcess() if needs_sampler_process(cfg) else None
