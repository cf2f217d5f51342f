"""How one rank replays its share of an update, as data: the plan laid out tree by tree.

The planner (`treetrain.memory.planner`) chooses tree or flat mode, K, chunking, the reference walk, a
retention budget and which internal units keep their first graph: one `Plan` for the update. When the
update's window opens, the plan is laid out over this rank's trees (`Plan.lay_out`,
`treetrain.memory.replay_layout`). Each tree gets a `TreeSchedule`: the replay steps and kept graphs the plan
implies, and the evictions (or host offloads) before each scoring batch and step. `TreeReplay` carries the
schedule out and decides nothing about memory itself: it checks that the walk it builds is the one the
schedule was made for, and refuses a schedule that does not match (`PlanMismatchError`). Without a
schedule, nothing is bounded or kept.

Example:
    >>> step = ReplayStep(0, (1, 2))
    >>> run = ScheduleRun(TreeSchedule("t", (step,), frozenset(), (Eviction(step, (3,)),)), print)
    >>> run.before(step)
    3
    >>> run.evicted
    1
    >>> ReplaySchedule((TreeSchedule("t", (step,), frozenset()),)).for_tree("t").steps == (step,)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from treetrain.errors import TreetrainError
from treetrain.replay.protocols import MemoryProbe
from treetrain.replay.schedule import ReplayStep
from treetrain.replay.scoring import ScoreBatch

if TYPE_CHECKING:
    import torch

StepHook = Callable[[str, ReplayStep], None]
"""Called with ("forward" | "backward", step) before each phase of a replay step."""


class PlanMismatchError(TreetrainError, ValueError):
    """The plan handed to the replay engine is not the one for the tree it replays (a planner bug)."""


@dataclass(frozen=True)
class Eviction:
    """Before `before` runs, the resident KV of `units` leaves the device (in this order)."""

    before: ScoreBatch | ReplayStep
    units: tuple[int, ...] = ()


@dataclass(frozen=True)
class TreeSchedule:
    """The planner's decisions for one tree of this rank, in the engine's terms."""

    tree_id: str
    steps: tuple[ReplayStep, ...]
    """The replay steps the plan was made for: the engine's own walk must have exactly these."""
    kept: frozenset[int]
    """Internal units whose first forward keeps its graph until their own step (`exact` mode)."""
    evictions: tuple[Eviction, ...] = ()
    """One entry per scoring batch and replay step, in execution order."""
    offload: bool = False
    """Evicted KV goes to host memory and is copied back, instead of being recomputed."""

    def check(self, steps: tuple[ReplayStep, ...], keepable: frozenset[int]) -> None:
        """Refuse this schedule unless it was made for a walk with `steps`, keeping only `keepable` units."""
        if steps != self.steps:
            differ = [i for i, (a, b) in enumerate(zip(steps, self.steps)) if a != b]
            first = differ[0] if differ else min(len(steps), len(self.steps))
            raise PlanMismatchError(
                f"tree {self.tree_id[:12]}: the plan was made for {len(self.steps)} replay steps, the engine's "
                f"walk has {len(steps)}, first different at step {first}"
            )
        if not self.kept <= keepable:
            raise PlanMismatchError(
                f"tree {self.tree_id[:12]}: the plan keeps the graphs of units {sorted(self.kept - keepable)}, "
                "which are not active internal units"
            )


@dataclass(frozen=True)
class ReplaySchedule:
    """One rank's share of the update's plan, laid out tree by tree: what the replayer carries out. None of
    it changes the gradient, only its cost."""

    trees: tuple[TreeSchedule, ...] = ()
    """One schedule per tree this rank replays."""

    def for_tree(self, tree_id: str) -> TreeSchedule:
        """The schedule of `tree_id`; a schedule laid out over other trees is refused."""
        for s in self.trees:
            if s.tree_id == tree_id:
                return s
        raise PlanMismatchError(
            f"the plan has no schedule for tree {tree_id[:12]}: it was laid out for other trees"
        )


@dataclass(frozen=True)
class ReplayHooks:
    """Seams the replay engine calls at fixed points, given at construction (tests inject faults here)."""

    step: StepHook | None = None
    """Called with ("forward" | "backward", step) before each phase of a replay step."""
    backward: Callable[[torch.Tensor], None] | None = None
    """Turns a step's loss into gradients: `loss.backward()` when None, the DeepSpeed engine's `backward`
    under ZeRO (so its gradient partitioning sees every call)."""
    tracker: MemoryProbe | None = None
    """Measures live bytes by lifetime class while the replayer runs (the report carries the peak)."""


class ScheduleRun:
    """Carries one tree's evictions out: before each scoring batch or step, what the schedule lists for it.

    `evict(u)` removes unit u's resident KV (or offloads it). An event the schedule does not list, in order,
    is refused: the engine would be running a walk the plan was not made for.
    """

    def __init__(self, schedule: TreeSchedule, evict: Callable[[int], object]) -> None:
        self.schedule = schedule
        self.evict = evict
        self.evicted = 0
        """Evictions made so far."""
        self._cursor = 0

    def before(self, event: ScoreBatch | ReplayStep) -> None:
        entries = self.schedule.evictions
        while self._cursor < len(entries) and entries[self._cursor].before != event:
            self._cursor += 1
        if self._cursor == len(entries):
            raise PlanMismatchError(
                f"tree {self.schedule.tree_id[:12]}: the engine ran {event}, which the plan does not list"
            )
        for u in entries[self._cursor].units:
            self.evict(u)
            self.evicted += 1
        self._cursor += 1
