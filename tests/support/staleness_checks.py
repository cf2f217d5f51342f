"""The version bound checked token by token from a run's tree files, for the asynchronous-training tests
(tests/train/test_async_training.py, tests/train/test_vllm_train.py)."""

from __future__ import annotations

from pathlib import Path

from treetrain.rollout.sources.produced import lags_of
from treetrain.rollout.sources.staleness import Staleness
from treetrain.rollout.sources.tree_queue import read_queued
from treetrain.train.metrics import UpdateMetrics
from treetrain.trajectory import Role


def queued_lags(run: Path, rows: list[UpdateMetrics]) -> dict[int, Staleness]:
    """Per update, the lags of every policy token of the trees queued for it, at the version it trained at
    (the version after the update before it), read token by token from the tree files."""
    out = {}
    for row in rows:
        before = rows[row.update - 1].version if row.update else 0
        out[row.update] = lags_of(read_queued(run, row.update).trees, before)
    return out


def within(lags: dict[int, Staleness], bound: int) -> bool:
    return all(
        s.least is not None and s.least >= 0 and s.most is not None and s.most <= bound for s in lags.values()
    )


def split_turns(run: Path, update: int) -> int:
    """Distinct turns of `update`'s queued trees whose tokens two versions drew (an interrupted sample that
    had drawn tokens): two policy segments in a row, told apart by the token path up to the second one."""
    seen = set()
    for tree in read_queued(run, update).trees:
        for trajectory in tree.trajectories():
            for call in trajectory.calls:
                path: tuple[int, ...] = ()
                for a, b in zip(call.segments, call.segments[1:]):
                    path += a.tokens
                    if a.role is b.role is Role.POLICY:
                        seen.add(path)
    return len(seen)
