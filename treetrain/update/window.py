"""An update's window, as data: what every rank agreed to replay before the optimizer step.

`open_window` is step 4 of `treetrain.update.run.run_update`: over the groups still in the update it takes
the manifest and batch (built once by the caller, or here again after a group was dropped), places the
trees over ranks, makes every rank agree on the resident identity (model version included), the manifest
digest and the placement digest before any compute, and lays the update's one `Plan` out over this rank's
trees. The result is a frozen `UpdateWindow`: manifest, placement, this rank's share, its coverage claims
and its plan with that plan's schedule. Nothing in it points back at the learner or changes it; what
happens to the window afterwards (replay, retries, a narrower plan, a dropped group) is
`treetrain.update.faults`, and the coverage check and the step are sections 6 and 7 of `run_update`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from treetrain.distributed.coverage import CoverageClaims
from treetrain.distributed.placement import Placement, place
from treetrain.loss.loss_config import LossConfig
from treetrain.loss.manifest import ContributionKey, Manifest, ManifestError
from treetrain.memory.context_cost import contributed_bytes
from treetrain.memory.planner import Plan
from treetrain.replay import UpdateBatch
from treetrain.replay.batch import TreeWork
from treetrain.replay.replay_schedule import ReplaySchedule
from treetrain.update.learner import Learner
from treetrain.update.window_types import Group

IDENTITY = "resident identity (model version, adapter, tokenizer, dtype, ...)"


@dataclass(frozen=True)
class UpdateWindow:
    """One update's agreed work on this rank (see module docstring). `claims` is the one mutable part: it
    records which contributions this rank has replayed, so a second replay of one is refused."""

    groups: tuple[Group, ...]
    alive: frozenset[int]
    """Indices of the groups still in the update (a dropped group is left out of everything below)."""
    version: int
    """The model version the update trains (every contribution key carries it)."""
    manifest: Manifest
    """The contributions of the whole update, all ranks together."""
    placement: Placement
    share: UpdateBatch
    """This rank's share of the update."""
    claims: CoverageClaims
    plan: Plan
    """The update's plan (after an out-of-memory error in backward, a narrower one)."""
    schedule: ReplaySchedule
    """`plan` laid out over `share`: each tree's steps, kept graphs and evictions."""
    context_bytes: int = 0
    """What this rank will put into its context group's collectives replaying `schedule`, by the per-rank
    ledger's transfer model (0 without a group): the prediction of what the engine counts."""

    @property
    def work(self) -> Mapping[str, TreeWork]:
        """This rank's trees, by id."""
        return {w.tree.id: w for w in self.share.work}

    def keys(self, work: TreeWork) -> tuple[ContributionKey, ...]:
        return work.contribution_keys(self.version)


def open_window(
    learner: Learner,
    groups: Sequence[Group],
    plan: Plan,
    loss: LossConfig,
    *,
    batch: UpdateBatch | None = None,
    alive: frozenset[int] | None = None,
    placement: Placement | None = None,
) -> UpdateWindow:
    """The window over `groups` (those in `alive`; all by default). `batch` is the whole update's batch when
    the caller already built it (for the planner) at this version; otherwise it is built here. `placement`
    is computed over the ranks unless given (restricted to the live groups' trees). Collective."""
    groups = tuple(groups)
    _check_groups(groups)
    alive = frozenset(range(len(groups))) if alive is None else alive
    backend, version = learner.backend, learner.version
    backend.agree(repr(learner.identity), IDENTITY)
    trees = [t for gi in sorted(alive) for t in groups[gi].trees]
    if batch is None:
        advantages = [a for gi in sorted(alive) for a in groups[gi].advantages]
        batch = UpdateBatch.build(trees, advantages, loss, version=version)
    if batch.manifest.version != version:
        raise ManifestError(f"the batch is for version {batch.manifest.version}, the model is at {version}")
    ctx = backend.context_size  # placed over data-parallel groups: a context group replays the same trees
    data_groups = backend.world_size // ctx
    placed = place(trees, data_groups) if placement is None else placement.restricted_to(trees)
    if placed.world_size != data_groups:
        raise ValueError(
            f"placement is for {placed.world_size} ranks, the backend has {data_groups} data groups"
        )
    backend.agree(batch.manifest.digest, "manifest digest")
    backend.agree(placed.digest, "placement")
    share = batch.restricted(dict(zip(placed.tree_ids, placed.for_rank(backend.rank // ctx))))
    claims = CoverageClaims(k for w in share.work for k in w.contribution_keys(version))
    schedule, crossing = laid_out(learner, plan, share, loss)
    backend.begin_window()
    return UpdateWindow(
        groups, alive, version, batch.manifest, placed, share, claims, plan, schedule, crossing
    )


def laid_out(
    learner: Learner, plan: Plan, share: UpdateBatch, loss: LossConfig
) -> tuple[ReplaySchedule, int]:
    """`plan` over this rank's `share`: the replay schedule, and the bytes the rank will put into its context
    group's collectives running it (`UpdateWindow.context_bytes`)."""
    module = learner.backend.module
    layout = plan.lay_out(share, module, loss, learner.ref_model)
    cfg = plan.config
    return layout.schedule, contributed_bytes(layout.trees, cfg.context_parallel, cfg.chunk_size or 0, module)


def _check_groups(groups: Sequence[Group]) -> None:
    """Each group has one advantage table per tree, and no tree is in the update twice."""
    seen: dict[str, int] = {}
    for gi, g in enumerate(groups):
        if len(g.trees) != len(g.advantages):
            raise ValueError(f"group {gi}: {len(g.trees)} trees but {len(g.advantages)} advantage tables")
        for t in g.trees:
            if t.id in seen:
                raise ManifestError(
                    f"tree {t.id[:12]} appears twice in the update (groups {seen[t.id]}, {gi})"
                )
            seen[t.id] = gi
