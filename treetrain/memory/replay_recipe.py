"""The planner's decision for an update, and its layout over one rank's trees as an immutable `ReplayPlan`.

A `ReplayRecipe` is what the planner decided for the whole update (mode, K, chunking, the reference walk,
a retention budget, the kept graphs), before anyone knows which trees a rank replays. When the update
window opens, `lay_out` turns it into the rank's `ReplayPlan`: for each tree, the replay steps, the kept
graphs and every eviction (or host offload) before each scoring batch and step, decided here by
`plan_retention` over the same uses the ledger prices (`treetrain.memory.events.plan_tree`). The replay
engine carries that plan out and never calls back into `treetrain.memory`.

After an out-of-memory error in backward the window asks for `narrower(k)` and lays it out again: a fresh
plan, never a patched one.

Example:
    >>> from treetrain.loss.advantages import AdvantageConfig, compute_advantages
    >>> from treetrain.models.presets import tiny_model
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> trees = [synthetic_group(prefix=16, branches=3, suffix=4, depth=1, vocab=64, seed=0)]
    >>> advantages = compute_advantages(trees, AdvantageConfig()).trees
    >>> loss = LossConfig()
    >>> batch = UpdateBatch.build(trees, advantages, loss)
    >>> layout = ReplayRecipe(config=ReplayConfig(microbatch=1)).lay_out(batch, tiny_model("llama", 64), loss)
    >>> [len(s.steps) for s in layout.plan.trees], layout.retention[0].recomputes
    ([4], 0)
    >>> ReplayRecipe(config=ReplayConfig(microbatch=4)).narrower(2).config.microbatch
    2
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from transformers import PreTrainedModel

from treetrain.errors import ConfigError
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.events import TreePlan, plan_tree
from treetrain.memory.persistent import kv_bytes_per_token, state_bytes_per_unit
from treetrain.memory.retention import RetentionPlan
from treetrain.models.lora import Reference
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.protocols import KeepGraph, MemoryProbe
from treetrain.replay.reference import fused_reference
from treetrain.replay.replay_plan import Eviction, Mode, ReplayPlan, TreeSchedule
from treetrain.replay.schedule import ReplayStep
from treetrain.replay.scoring import ScoreBatch


@dataclass(frozen=True)
class Layout:
    """A recipe laid out over one rank's batch: the engine's plan, and the retention plan of each tree."""

    plan: ReplayPlan
    trees: tuple[TreePlan, ...] = ()
    """What the planner derived for each tree (uses, retention plan, forward events), in batch order."""

    @property
    def retention(self) -> tuple[RetentionPlan, ...]:
        """Each tree's retention plan: its evictions, minimum feasible budget, peak and recomputes."""
        return tuple(t.plan for t in self.trees)


@dataclass(frozen=True)
class ReplayRecipe:
    """How an update replays, before it is laid out over a rank's trees (see module docstring)."""

    mode: Mode = "tree"
    """tree: `TreeReplay`; flat: the conventional per-call `FlatReference`."""
    config: ReplayConfig = field(default_factory=ReplayConfig)
    """Contract, K, chunk size, order and reference walk."""
    retention: int | None = None
    """Retention budget for resident state in bytes; None keeps all of it."""
    host_tier: bool = False
    """Offload evicted KV to (pinned) host memory and copy it back when needed, instead of recomputing it.
    Worth it on a GPU, where host memory is separate; on a CPU it frees nothing."""
    keep_graph: KeepGraph | None = None
    """`exact` mode: internal units whose first forward keeps its graph until their own step."""
    tracker: MemoryProbe | None = None
    """Measures live bytes by lifetime class while the plan runs (the report carries the peak)."""

    def __post_init__(self) -> None:
        if self.retention is not None and self.retention < 0:
            raise ConfigError(f"retention budget must be >= 0 bytes, got {self.retention}")

    @staticmethod
    def of(plan: ReplayRecipe | ReplayPlan | ReplayConfig | None) -> ReplayRecipe:
        """`plan` as a recipe. A `ReplayPlan` already laid out is for one batch only and is refused."""
        if isinstance(plan, ReplayRecipe):
            return plan
        if isinstance(plan, ReplayPlan):
            if plan.trees is not None:
                raise ConfigError("a laid-out ReplayPlan holds one batch's schedules; pass its ReplayRecipe")
            return ReplayRecipe(plan.mode, plan.config, tracker=plan.tracker)
        return ReplayRecipe(config=plan or ReplayConfig())

    def narrower(self, k: int) -> ReplayRecipe:
        """The same decision with at most `k` sibling rows per replay step."""
        return replace(self, config=replace(self.config, microbatch=k))

    def lay_out(
        self, batch: UpdateBatch, model: PreTrainedModel, loss: LossConfig, ref_model: Reference | None = None
    ) -> Layout:
        """The plan for replaying `batch` (this rank's share) on `model`: one `TreeSchedule` per tree in
        tree mode. Raises `BudgetTooSmallError` when the retention budget is below a tree's minimum."""
        if self.mode == "flat":
            return Layout(ReplayPlan("flat", self.config, tracker=self.tracker))
        per_token, per_unit = kv_bytes_per_token(model), state_bytes_per_unit(model)
        fused = fused_reference(loss, self.config, ref_model)
        trees = tuple(
            plan_tree(
                work, self.config, loss, kv_bytes_per_token=per_token, state_bytes_per_unit=per_unit,
                budget=self.retention, keep_graph=self.keep_graph, host_tier=self.host_tier,
                fused_reference=fused,
            )
            for work in batch.work
        )  # fmt: skip
        schedules = tuple(_schedule(work.tree.id, t, self.host_tier) for work, t in zip(batch.work, trees))
        return Layout(ReplayPlan("tree", self.config, schedules, self.tracker), trees)


def _schedule(tree_id: str, tree: TreePlan, offload: bool) -> TreeSchedule:
    """The engine's view of one tree's plan: steps, kept graphs, and the evictions before each event."""
    evictions = tuple(
        Eviction(use.event, evicted)
        for use, evicted in zip(tree.uses, tree.plan.evict)
        if isinstance(use.event, (ScoreBatch, ReplayStep))
    )
    return TreeSchedule(tree_id, tree.steps, tree.kept, evictions, offload)
