"""One update's trees as a tree source hands them to the trainer, with what it cost to get them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from treetrain.rollout.sources.staleness import Dropped, Staleness
from treetrain.tree import TrajectoryTree


@dataclass(frozen=True)
class Produced:
    """One update's advantage groups (each a tuple of trees normalized together), how long they took, and
    how many tasks were lost to environment failures (their groups are not among `groups`)."""

    groups: tuple[tuple[TrajectoryTree, ...], ...]
    seconds: float
    failed_episodes: int = 0
    step_timeouts: int = 0
    """Environment steps that missed their deadline (all ranks)."""
    interrupted: int = 0
    """Samples stopped mid-turn for newer weights and resubmitted (all ranks; asynchronous runs only)."""
    staleness: Staleness = field(default_factory=Staleness)
    """Version lags of the policy tokens of `groups` (empty for recorded trees: their versions are another
    run's)."""
    stale: Dropped = field(default_factory=Dropped)
    """Groups left out for a token over `rollout.max_staleness` (not among `groups`)."""
    queue_depth: int = 0
    """Later updates' rollouts finished and waiting when these trees were taken."""
    sampler_idle: float = 0.0
    """Seconds the sampler waited for the pacing rule before growing these trees."""
    trainer_idle: float = 0.0
    """Seconds the trainer waited for these trees (all of `seconds` in a synchronous rollout)."""
    servers_lost: int = 0
    """`vllm-server`: servers lost while these trees grew."""
    servers: tuple[tuple[str, int, int, float], ...] = ()
    """`vllm-server`: each server's share (`ServerStats.row`), every rank's requests summed."""
    weight_sync_bytes: int = 0
    """Bytes the weight syncs of this rollout (the one before it, and an asynchronous run's during it) sent
    to the engines, summed over ranks: a fleet's files are written once, by rank 0."""
    weight_sync_seconds: float = 0.0
    """Seconds those syncs took on rank 0."""
    weight_publish_seconds: float = 0.0
    """Seconds the training thread spent publishing the weights after the previous step (an asynchronous
    run's `WeightFeed` or `ServedFeed`)."""

    @property
    def trees(self) -> tuple[TrajectoryTree, ...]:
        return tuple(t for g in self.groups for t in g)


def lags_of(trees: Sequence[TrajectoryTree], version: int) -> Staleness:
    """The version lags of every policy token of `trees`, trained at `version`."""
    out = Staleness()
    for tree in trees:
        out = out.merged(Staleness.of(tree, version))
    return out
