"""What the scheduler keeps track of while trees grow: tasks, their branch points, the requests sent for
them, and the forks of each sample being stepped.

`treetrain.rollout.scheduler.Scheduler` moves these records between the engine and the step pool; they are
kept apart so that the records, and the two rules every tree shares whatever grows it (a branch point's
seed from its place in the tree, `request_seed`, and freeing an episode without failing another task,
`release`), can be read without the scheduling itself. `treetrain.rollout.sequential` uses `release` too.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field

from envs.env_error import EnvError
from envs.protocol import Rubric
from envs.wrapper import TokenEnv
from treetrain.rollout.engines.generation import Completion, Draft, GenerationRequest, StopMatcher
from treetrain.trajectory import Trajectory

Key = tuple[tuple[int, int], ...]
"""Depth-first order of the sequential loop: per level (0 = finished there, 1 = continued; child index)."""


@dataclass
class Task:
    """One tree being grown: its root episode, how its trajectories are named and rewarded, and its state."""

    seed: int
    root: TokenEnv
    prefix: str
    rubric: Rubric | None
    finished: list[tuple[Key, Trajectory]] = field(default_factory=list)
    live: set[TokenEnv] = field(default_factory=set)
    """Episodes held by a pending request or step: released when the task ends or fails."""
    failure: EnvError | None = None
    pending: int = 0
    """Requests and steps of this task in flight; at 0 the tree is finished."""

    def trajectories(self) -> list[Trajectory]:
        return [t for _, t in sorted(self.finished, key=lambda kt: kt[0])]


@dataclass
class BranchPoint:
    """A branch point: an episode whose next turn is being sampled."""

    task: Task
    episode: TokenEnv
    depth: int
    path: tuple[int, ...]
    key: Key
    at_root: bool = False


@dataclass
class Asked:
    """A branch point's request and its samples as they come back (from several requests once the first
    was interrupted for new weights)."""

    point: BranchPoint
    request: GenerationRequest
    samples: list[Completion | None]
    abandoned: bool = False
    """Its task failed while a sample waited to go on: nothing more is sent or delivered for it."""
    stops: StopMatcher = field(init=False)
    """The request's stops, which cut a sample joined from its parts."""

    def __post_init__(self) -> None:
        self.stops = StopMatcher.of(self.request.stop)


@dataclass(frozen=True)
class Sent:
    """One request the engine holds: the whole of `asked` (`slots` None), or the rest of those of its samples
    that had drawn `draft` when they were interrupted (one sample each, in `slots` order)."""

    asked: Asked
    slots: tuple[int, ...] | None = None
    draft: Draft = field(default_factory=Draft)


@dataclass
class Fork:
    """One fork of one sample, to be stepped in the pool."""

    task: Task
    parent: TokenEnv
    sample: Completion
    branch: int
    depth: int
    path: tuple[int, ...]
    key: Key


def request_seed(base_seed: int, task_seed: int, key: Key) -> int:
    """The seed of one branch point's samples: the sampler seed, its task seed and its place in the tree.

    >>> request_seed(0, 7, ((1, 0),)) == request_seed(0, 7, ((1, 0),)) != request_seed(0, 7, ((1, 1),))
    True
    """
    digest = hashlib.blake2b(repr((base_seed, task_seed, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def release(episode: TokenEnv) -> None:
    """Free an episode's environment once nothing needs it (best effort: a failed release is the
    environment's own problem and must not end another task)."""
    with contextlib.suppress(Exception):  # whatever a release raises, the episode is over
        episode.release()
