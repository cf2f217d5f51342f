"""What an update does with tasks lost to environment code: log them, count them, and stop when too many.

A failure of one task's episode (`envs.env_error.EnvError`: environment code raising in `reset`, `step`,
`fork` or a rubric, a worker that died, a call past its deadline, a prompt longer than the episode budget,
a chat template that refuses the conversation, any other exception of the token wrapper) ends its task's
tree, so that task's group is dropped whole and never
reaches the manifest: advantages are normalized only over complete groups, and exactly-once accounting
never sees the group at all. The full tracebacks go to `<run_dir>/env-errors/update-XXXXX.log` (one file
per update and rank, written atomically), the count to `UpdateMetrics.failed_episodes`, and when every task
of an update fails, or more than `rollout.max_failed_fraction` of them, the run stops with one line naming
the environment, the method, the exception and the log file.

Example:
    >>> from envs.env_error import EnvError
    >>> lost = (TaskFailure(7, EnvError("maze", "step", "ValueError: wall"), "env-errors/update-00000.log"),)
    >>> too_many(lost, tasks=4, max_fraction=0.5) is None
    True
    >>> print(too_many(lost, tasks=1, max_fraction=0.5))
    every task failed (1 of 1, rollout.max_failed_fraction=0.5); first: maze: step raised ValueError: wall; traceback in env-errors/update-00000.log
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from envs.env_error import EnvError
from treetrain.errors import TreetrainError
from treetrain.io import atomic_write_text
from treetrain.rollout.sources.run_settings import Ranks
from treetrain.runfs import make_dirs

ENV_ERRORS = "env-errors"
"""The run directory's folder of environment tracebacks, one `update-NNNNN.log` per update (and rank) with a
failure."""


class EnvironmentFailedError(TreetrainError, RuntimeError):
    """Environment code failed in too many of an update's tasks; the message is the one line to show."""


@dataclass(frozen=True)
class TaskFailure:
    """One task (rollout seed) whose tree was lost, the failure, and the file holding its traceback."""

    seed: int
    error: EnvError
    log: str


def log_path(run_dir: str | Path, update: int, rank: int = 0) -> Path:
    suffix = "" if rank == 0 else f"-rank{rank}"
    return Path(run_dir) / ENV_ERRORS / f"update-{update:05d}{suffix}.log"


def write_failures(
    run_dir: str | Path, update: int, rank: int, failures: Sequence[tuple[int, EnvError]]
) -> tuple[TaskFailure, ...]:
    """Write this rank's failures of one update to their log file (atomically; none: no file)."""
    if not failures:
        return ()
    path = log_path(run_dir, update, rank)
    make_dirs(run_dir, path.parent)  # a planted link on the way is refused, not followed
    parts = []
    for seed, error in failures:
        body = error.traceback or "(no traceback: the worker process did not report one)\n"
        parts.append(f"== task seed {seed}: {error.line()}\n{body.rstrip()}\n")
    atomic_write_text(path, "\n".join(parts))
    return tuple(TaskFailure(seed, error, str(path)) for seed, error in failures)


def share_failures(backend: Ranks, local: Sequence[TaskFailure]) -> tuple[TaskFailure, ...]:
    """Every rank's failures (tracebacks stay in each rank's file), so all ranks decide alike."""
    if backend.world_size == 1:
        return tuple(local)
    payload = json.dumps(
        [[f.seed, f.error.env, f.error.method, f.error.exception, f.error.where, f.log] for f in local]
    )
    out = []
    for part in backend.gather(payload):
        for seed, env, method, exception, where, log in json.loads(part):
            out.append(TaskFailure(int(seed), EnvError(env, method, exception, where), log))
    return tuple(sorted(out, key=lambda f: f.seed))


def too_many(failures: Sequence[TaskFailure], tasks: int, max_fraction: float) -> str | None:
    """The line that stops the run, or None while the failures are within `max_fraction` of `tasks`."""
    if not failures:
        return None
    lost = len(failures)
    if lost < tasks and lost <= max_fraction * tasks:
        return None
    first = failures[0]
    how = "every task failed" if lost >= tasks else "environment code failed in too many tasks"
    return (
        f"{how} ({lost} of {tasks}, rollout.max_failed_fraction={max_fraction:g}); first: {first.error.line()}; "
        f"traceback in {first.log}"
    )
