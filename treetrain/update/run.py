"""One update, top to bottom: the steps of docs/design.md § One update, each done by the module it names.

`run_update` is the whole of an update; the trainer (`treetrain.train.loop`) calls it once per optimizer
step and keeps only the run around it (rollouts, metrics, checkpoints), and the tests drive it as it is.
The Python API and `treetrain plan` run a prefix of the same steps through the same modules:

1. **Advantages** per group (`treetrain.loss.advantages`). A group whose rewards are all equal carries no
   policy gradient; it is left out before anything is built, so it never dilutes a denominator.
2. **Manifest and batch, once** (`treetrain.loss.manifest`, `treetrain.replay.batch`): the exact set of
   contributions of this step, and each node's loss targets normalized by that manifest alone.
3. **Plan** (`treetrain.update.planning` → `treetrain.memory.planner`): tree or flat, K, chunking, retention,
   kept graphs and the reference walk, priced by the memory ledger against the budget: one `Plan`.
4. **Open the window** (`treetrain.update.window`): the trees placed over ranks
   (`treetrain.distributed.placement`), identity, manifest and placement agreed by every rank, and the plan
   laid out over this rank's trees; a frozen `UpdateWindow`.
5. **Score and replay** each tree of this rank (`treetrain.replay.tree_replay`, or the flat reference
   `treetrain.replay.flat_reference`), retrying, narrowing and dropping what failed (`treetrain.update.faults`).
6. **Check coverage** (`treetrain.distributed.coverage`): every manifest key covered exactly once over all
   ranks, or the step is refused.
7. **Step and advance** (`treetrain.update.learner`, the backend's optimizer): the model version goes up,
   and resident state of the old version becomes unreadable (`treetrain.replay.resident`).

The loss is resolved once (`UpdateSettings.policy_loss`) and the same object builds the batch, prices the
plan and drives the replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from treetrain.distributed.coverage import require_coverage
from treetrain.distributed.placement import Placement
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.memory.planner import Plan
from treetrain.replay import UpdateBatch
from treetrain.replay.protocols import MemoryProbe
from treetrain.tree.trajectory_tree import TrajectoryTree
from treetrain.update.faults import replay_window
from treetrain.update.learner import Learner
from treetrain.update.planning import plan_for
from treetrain.update.settings import UpdateSettings
from treetrain.update.window import IDENTITY, open_window
from treetrain.update.window_types import Group, WindowReport


@dataclass(frozen=True)
class UpdateOutcome:
    """What one `run_update` did."""

    zero_variance: int
    """Groups left out because every reward in them was equal."""
    groups: tuple[Group, ...] = ()
    """The groups the update was built from (a group that failed in replay is in `report.dropped`)."""
    plan: Plan | None = None
    """The planner's decision; None when no group was left to train on (and no step was taken)."""
    report: WindowReport | None = None
    """The step: version, contributions, this rank's replay sums, dropped groups."""
    predicted_context_bytes: int = 0
    """What the per-rank ledger predicted this rank would put into its context group's collectives (the
    engine's count is `report.local.crossed_bytes`; 0 without a group)."""


def advantage_groups(
    rollouts: Sequence[Sequence[TrajectoryTree]], cfg: AdvantageConfig
) -> tuple[list[Group], int]:
    """The update's advantage groups (one per tuple of trees), and how many were left out because every
    reward in them was equal (with `zero_variance='drop'`: they would only dilute the normalization)."""
    groups, zero_variance = [], 0
    for trees in rollouts:
        advantages = compute_advantages(list(trees), cfg)
        if advantages.zero_variance and cfg.zero_variance == "drop":
            zero_variance += 1
        else:
            groups.append(Group(tuple(trees), advantages.trees))
    return groups, zero_variance


def run_update(
    learner: Learner,
    cfg: UpdateSettings,
    rollouts: Sequence[Sequence[TrajectoryTree]],
    *,
    tracker: MemoryProbe | None = None,
    placement: Placement | None = None,
) -> UpdateOutcome:
    """One optimizer step over `rollouts` (one tuple of trees per advantage group) on `learner`'s backend.

    `tracker`, if given, measures this update's replay by lifetime class against the ledger's prediction;
    `placement`, if given, says which rank replays which trajectories (otherwise it is computed).
    """
    backend, loss = learner.backend, cfg.policy_loss

    # 1. Advantages per group; groups without reward variance are left out (treetrain.loss.advantages).
    groups, zero_variance = advantage_groups(rollouts, cfg.advantages)
    if not groups:
        return UpdateOutcome(zero_variance)

    # 2. The manifest and the batch, once: normalization comes from the manifest alone.
    trees = [t for g in groups for t in g.trees]
    advantages = [a for g in groups for a in g.advantages]
    batch = UpdateBatch.build(trees, advantages, loss, version=learner.version)

    # 3. Plan: mode, K, chunking, retention, kept graphs, reference walk (priced by the memory ledger).
    with backend.scratch():  # planning may calibrate with real backward passes
        plan = plan_for(
            cfg, batch, backend.module, learner.ref_model, world_size=backend.world_size,
            zero_stage=backend.zero_stage, offload_optimizer=backend.offload_optimizer,
            context_parallel=backend.context_size,
        )  # fmt: skip

    # 4. Open the window: placement, identity, manifest and placement agreed, the plan laid out for this rank.
    window = open_window(learner, groups, plan, loss, batch=batch, placement=placement)

    # 5. Score and replay every tree this rank owns: retry, narrow after out-of-memory, drop failed groups.
    window, replayed = replay_window(learner, window, loss, tracker)

    # 6. Coverage, collectively: the same identity and manifest everywhere, every contribution exactly once.
    backend.agree(repr(learner.identity), IDENTITY)
    backend.agree(window.manifest.digest, "manifest digest")
    require_coverage(backend.gather, window.claims, window.manifest.keys(), context=backend.context_size)

    # 7. The optimizer step, and the next model version (old resident state becomes unreadable).
    report = learner.step(window.manifest, window.placement, replayed)
    return UpdateOutcome(zero_variance, tuple(groups), plan, report, window.context_bytes)
