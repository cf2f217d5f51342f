"""What a run checks before torch, transformers, the model or the engine load: one line for each mistake.

Loading torch and the model takes seconds to a minute, so every mistake that can be seen without them is
answered first, in the order a user would fix them: the environment (its name, its `env.kwargs`, a task
file that is missing or has a bad row, its rubric; `treetrain.rollout.env_check`), the held-out tasks, the
`vllm serve` processes of `rollout.engine=vllm-server` (one `GET /v1/models` each, with a short timeout),
then the run directory (claimed and locked; `treetrain.train.rundir`) and, for `--resume`, the settings a
resume may change. `treetrain train` calls `preflight` before it imports the trainer, and hands the result
to `Trainer`; a `Trainer` built without one runs the same checks itself. Nothing here imports torch
(`tests/cli/test_cli_paths.py` checks `sys.modules` after each of these errors).

Example:
    >>> from treetrain.train.config import load_config
    >>> preflight(load_config(None, ["env.name=nosuch"]), resume=False, overwrite=False)
    Traceback (most recent call last):
    ...
    envs.registry.UnknownEnvironmentError: unknown environment 'nosuch'. Available: ...
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from treetrain.rollout.engines.server_calls import check_reachable
from treetrain.rollout.env_check import check_environment_config
from treetrain.train.config import TrainConfig
from treetrain.train.held_out import HeldOut, check_disjoint, held_out_tasks, task_seeds
from treetrain.train.resume import SAVED_CONFIG, check_resumable, saved_config
from treetrain.train.rundir import RunLock, claim_run_dir


@dataclass(frozen=True)
class Preflight:
    """What the checks found and hold: the held-out tasks (None: no evaluation) and the run directory's lock
    (None on a rank other than 0, which never claims it)."""

    held: HeldOut | None
    lock: RunLock | None


def check_inputs(cfg: TrainConfig) -> HeldOut | None:
    """Every check that writes nothing: the environment, the held-out tasks and the servers."""
    if not cfg.rollout.trees:
        e = cfg.env
        check_environment_config(
            e.name, e.kwargs, e.rubric, task_seeds(cfg, 0)[0], cfg.rollout.episode.step_timeout_s
        )
    check_disjoint(cfg)
    held = held_out_tasks(cfg.env.name, cfg.env.kwargs, cfg.eval.tasks) if cfg.eval.every else None
    if cfg.rollout.engine == "vllm-server" and not cfg.rollout.trees:
        check_reachable(cfg.rollout.vllm.urls)
    return held


def preflight(cfg: TrainConfig, *, resume: bool, overwrite: bool) -> Preflight:
    """`check_inputs`, then claim the run directory (rank 0) and, for a resume, refuse settings it may not
    change (every rank). The lock is released again when the resume check refuses."""
    held = check_inputs(cfg)
    run_dir = Path(cfg.run_dir)
    rank = int(os.environ.get("RANK", "0"))  # known from the launcher before any backend exists
    lock = claim_run_dir(run_dir, resume=resume, overwrite=overwrite) if rank == 0 else None
    try:
        if resume:  # the same run: only the settings a resume may change differ
            check_resumable(saved_config(run_dir), cfg, run_dir / SAVED_CONFIG)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Preflight(held, lock)
