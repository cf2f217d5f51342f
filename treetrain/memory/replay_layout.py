"""The update's plan laid out over one rank's trees: each tree's steps, kept graphs and evictions.

The planner decides for the whole update (mode, K, chunking, the reference walk, a retention budget, the
kept graphs: `treetrain.memory.planner.Plan`), before anyone knows which trees a rank replays. When the
update's window opens, `lay_out` turns those choices into the rank's `ReplaySchedule`: for each tree, the
replay steps, the kept graphs and every eviction (or host offload) before each scoring batch and step,
decided here by `plan_retention` over the same uses the ledger prices (`treetrain.memory.events.plan_tree`).
The replayer carries that schedule out and never calls back into `treetrain.memory`. After an
out-of-memory error in backward the update lays a narrower plan out again: a fresh schedule, never a
patched one.

Example:
    >>> from treetrain.loss.advantages import AdvantageConfig, compute_advantages
    >>> from treetrain.models.presets import tiny_model
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> trees = [synthetic_group(prefix=16, branches=3, suffix=4, depth=1, vocab=64, seed=0)]
    >>> advantages = compute_advantages(trees, AdvantageConfig()).trees
    >>> loss = LossConfig()
    >>> batch = UpdateBatch.build(trees, advantages, loss)
    >>> layout = lay_out(batch, tiny_model("llama", 64), loss, ReplayConfig(microbatch=1))
    >>> [len(s.steps) for s in layout.schedule.trees], layout.retention[0].recomputes
    ([4], 0)
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from treetrain.errors import ConfigError
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.events import TreeLayout, plan_tree
from treetrain.memory.persistent import kv_bytes_per_token, state_bytes_per_unit
from treetrain.memory.retention import Retention
from treetrain.models.lora import Reference
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.protocols import KeepGraph
from treetrain.replay.reference import fused_reference
from treetrain.replay.replay_schedule import Eviction, ReplaySchedule, TreeSchedule
from treetrain.replay.schedule import ReplayStep
from treetrain.replay.scoring import ScoreBatch


@dataclass(frozen=True)
class Layout:
    """Choices laid out over one rank's batch: the replayer's schedule, and what it was derived from."""

    schedule: ReplaySchedule
    trees: tuple[TreeLayout, ...] = ()
    """What was derived for each tree (uses, retention, forward events), in batch order."""

    @property
    def retention(self) -> tuple[Retention, ...]:
        """Each tree's retention: its evictions, minimum feasible budget, peak and recomputes."""
        return tuple(t.retention for t in self.trees)


def lay_out(
    batch: UpdateBatch,
    model: PreTrainedModel,
    loss: LossConfig,
    config: ReplayConfig,
    *,
    retention: int | None = None,
    keep_graph: KeepGraph | None = None,
    host_tier: bool = False,
    ref_model: Reference | None = None,
) -> Layout:
    """The schedule for replaying `batch` (this rank's share) on `model` with `config`: one `TreeSchedule`
    per tree. `retention` bounds resident bytes (None keeps everything), `keep_graph` picks internal units
    whose first forward keeps its graph (`exact` mode), and `host_tier` offloads evicted KV to host memory
    instead of recomputing it (worth it on a GPU; on a CPU it frees nothing). Raises `BudgetTooSmallError`
    when the retention budget is below a tree's minimum."""
    if retention is not None and retention < 0:
        raise ConfigError(f"retention budget must be >= 0 bytes, got {retention}")
    per_token, per_unit = kv_bytes_per_token(model), state_bytes_per_unit(model)
    fused = fused_reference(loss, config, ref_model)
    trees = tuple(
        plan_tree(
            work, config, loss, kv_bytes_per_token=per_token, state_bytes_per_unit=per_unit,
            budget=retention, keep_graph=keep_graph, host_tier=host_tier, fused_reference=fused,
        )
        for work in batch.work
    )  # fmt: skip
    schedules = tuple(_schedule(work.tree.id, t, host_tier) for work, t in zip(batch.work, trees))
    return Layout(ReplaySchedule(schedules), trees)


def _schedule(tree_id: str, tree: TreeLayout, offload: bool) -> TreeSchedule:
    """The replayer's view of one tree's layout: steps, kept graphs, and the evictions before each event."""
    evictions = tuple(
        Eviction(use.event, evicted)
        for use, evicted in zip(tree.uses, tree.retention.evict)
        if isinstance(use.event, (ScoreBatch, ReplayStep))
    )
    return TreeSchedule(tree_id, tree.steps, tree.kept, evictions, offload)
