"""The `hf` sampler's process, started as early as a run can start it.

An asynchronous run's `hf` engine samples in a process of its own, whose start-up is mostly imports
(`treetrain.rollout.engines.sampler_process`). `early_sampler(cfg)` spawns it at once when the run will
use it, so its imports overlap the trainer's own start (its imports, the model, the backend) instead of
delaying the first rollout. `treetrain train` calls it right after its imports (`fresh`: a fork where that
is safe); `Trainer` calls it itself, first thing, when it was given none, and hands it to its source
(`SourceInputs.sampler`) without looking inside.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from treetrain.rollout.engines.sampler_process import SamplerProcess, fork_is_safe

if TYPE_CHECKING:
    from treetrain.rollout.sources.run_settings import RunSettings

__all__ = ["SamplerProcess", "early_sampler", "needs_sampler_process"]


def needs_sampler_process(cfg: RunSettings, rank: int | None = None) -> bool:
    """Whether this process samples in an `hf` sampler process: `rollout.max_staleness` >= 1 with the `hf`
    engine, growing its own rollouts (recorded trees have no sampler), on every rank, or under ZeRO-3 on
    rank 0 only (`treetrain.rollout.gathered_feed`). `rank`: this process's (None: torchrun's `RANK`)."""
    r, d = cfg.rollout, cfg.distributed
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    # under ZeRO-3 rank 0 alone samples; a DeepSpeed JSON's own stage is known once it is read, so with one
    # every rank starts a process (those that take no sampler close it)
    one_sampler = d.backend == "deepspeed" and d.zero_stage == 3 and d.deepspeed_config is None
    return r.max_staleness >= 1 and r.engine == "hf" and not r.trees and (rank == 0 or not one_sampler)


def early_sampler(cfg: RunSettings, *, fresh: bool = False) -> SamplerProcess | None:
    """A sampler process, started now, when the run will need one; else None. `fresh`: this process has
    imported its modules and computed nothing yet (`treetrain train`), so where that is safe
    (`fork_is_safe`: no CUDA) the sampler is a fork of it, which needs no imports of its own (about 5 s of
    CPU less, on a machine whose cores are all busy as much as on an idle one); otherwise it is spawned."""
    if not needs_sampler_process(cfg):
        return None
    return SamplerProcess("fork" if fresh and fork_is_safe() else "spawn")
