"""How one update's gradient is computed, as one object: what the planner decided, in the engine's terms.

The planner (`treetrain.memory.planner`) chooses tree or flat mode, K, chunking, the reference walk, a
retention budget and which internal units keep their first graph; `Plan.replay()` hands all of it to the
engine as a `ReplayPlan`. `TreeReplay` takes this one object instead of collaborators passed one by one,
so what an update does is readable in one place. A bare `ReplayConfig` is a plan with nothing bounded.

Example:
    >>> plan = ReplayPlan.of(ReplayConfig(contract="exact", microbatch=2))
    >>> plan.mode, plan.config.microbatch, plan.retention is None
    ('tree', 2, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from treetrain.errors import ConfigError
from treetrain.replay.batch import ReplayConfig
from treetrain.replay.protocols import KeepGraph, MemoryProbe, RetentionHook

Mode = Literal["tree", "flat"]


@dataclass(frozen=True)
class ReplayPlan:
    """Everything that decides how one update is replayed. None of it changes the gradient, only its cost."""

    mode: Mode = "tree"
    """tree: `TreeReplay` (contract from `config`); flat: the conventional per-call `FlatReference`."""
    config: ReplayConfig = field(default_factory=ReplayConfig)
    """Contract, K (`microbatch`: the rows of one forward and backward under autograd, sibling units in
    tree mode, whole calls in flat mode), chunk size, order and reference walk."""
    retention: RetentionHook | None = None
    """Bounds resident state to a byte budget by evicting (and recomputing) KV; None keeps all of it."""
    keep_graph: KeepGraph | None = None
    """`exact` mode: internal units whose first forward keeps its graph until their own step."""
    tracker: MemoryProbe | None = None
    """Measures live bytes by lifetime class while this plan runs (the report carries the peak)."""

    def __post_init__(self) -> None:
        if self.mode not in ("tree", "flat"):
            raise ConfigError(f"mode must be 'tree' or 'flat', got {self.mode!r}")

    @staticmethod
    def of(plan: ReplayPlan | ReplayConfig | None) -> ReplayPlan:
        """`plan` as a `ReplayPlan`: a bare config is tree mode with nothing bounded or kept."""
        if isinstance(plan, ReplayPlan):
            return plan
        return ReplayPlan(config=plan or ReplayConfig())
