"""The engine from Python, without the trainer: trajectories in, an exact tree gradient in `.grad` out.

`tree_update` is the whole sequence in one call: build the tree, compute advantages, build the update
batch (targets and the manifest that normalizes them), replay it. `build_batch` is the middle step, for
callers that drive `TreeReplay` or the flat reference (`treetrain.replay.FlatReference`) themselves, for
example to compare the two (`treetrain.replay.verify`). The optimizer step stays the caller's, as does
zeroing gradients: like `loss.backward()`, both functions *accumulate* into the parameters' `.grad`.

Example:
    >>> import torch
    >>> from treetrain import Call, Role, Segment, Trajectory, tree_update
    >>> from treetrain.models.presets import tiny_model
    >>> model = tiny_model("llama", 64)                     # random init, 2 layers, vocabulary of 64
    >>> prompt = Segment(Role.PROMPT, tuple(range(1, 17)))  # 16 shared prompt tokens
    >>> trajs = [Trajectory(f"t{i}", (Call((prompt, Segment(Role.POLICY, (20 + i, 30, 31)))),), float(i))
    ...          for i in range(4)]
    >>> report = tree_update(model, trajs)
    >>> report.trajectories, report.dropped_groups, report.token_cost < report.flat_token_cost
    (4, 0, True)
    >>> model.model.embed_tokens.weight.grad.abs().sum() > 0
    tensor(True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from treetrain.loss.advantages import AdvantageConfig, TreeAdvantages, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.replay.batch import ReplayConfig, ReplayReport, UpdateBatch
from treetrain.trajectory import Trajectory
from treetrain.tree.build import build_tree
from treetrain.tree.stats import tree_stats
from treetrain.tree.trajectory_tree import TrajectoryTree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Group = TrajectoryTree | Sequence[TrajectoryTree]
"""One advantage group: a tree, or several trees whose leaves are normalized together."""


@dataclass(frozen=True)
class BatchBuild:
    """An update batch and what was left out of it."""

    batch: UpdateBatch
    """Trees, per-node loss targets and the manifest; pass it to `TreeReplay(...).accumulate`."""
    dropped_groups: tuple[int, ...]
    """Indices of groups left out because every reward in them was equal (`zero_variance="drop"`)."""


@dataclass(frozen=True)
class TreeUpdateReport:
    """What one `tree_update` did. The gradient itself is in the parameters' `.grad`."""

    replay: ReplayReport
    """The engine's sums: loss terms, tokens run with and without a graph, steps, recomputes, peak."""
    trees: int
    """Trees replayed (after dropping zero-variance groups)."""
    trajectories: int
    """Trajectories whose loss is in the gradient."""
    dropped_groups: int
    """Groups left out because all their rewards were equal (no advantage, so no policy gradient)."""
    flat_token_cost: int
    """What the conventional per-trajectory run would cost in token units (forward 1, backward 2)."""

    @property
    def loss(self) -> float:
        """The update's loss (already normalized by the manifest)."""
        return self.replay.loss

    @property
    def token_cost(self) -> int:
        """Token units the tree replay actually spent, on the same scale as `flat_token_cost`."""
        return self.replay.token_cost


def build_batch(
    groups: Sequence[Group],
    *,
    loss: LossConfig | None = None,
    advantages: AdvantageConfig | None = None,
    version: int = 0,
) -> BatchBuild:
    """Advantages per group, then one `UpdateBatch` over every kept tree, normalized by one manifest.

    `version` is the model version the manifest's contributions are keyed by (the trainer counts optimizer
    steps; any integer works for a single update).

    Example:
        >>> from treetrain import Call, Role, Segment, Trajectory, build_batch, build_tree
        >>> def traj(i, reward):
        ...     return Trajectory(f"t{i}", (Call((Segment(Role.PROMPT, (1, 2)), Segment(Role.POLICY, (3 + i,)))),), reward)
        >>> kept, flat = build_tree([traj(0, 0.0), traj(1, 1.0)]), build_tree([traj(0, 1.0), traj(1, 1.0)])
        >>> built = build_batch([kept, flat])
        >>> len(built.batch.work), built.dropped_groups, len(built.batch.manifest.entries)
        (1, (1,), 2)
    """
    loss = loss or LossConfig()
    adv_cfg = advantages or AdvantageConfig()
    trees: list[TrajectoryTree] = []
    tables: list[TreeAdvantages] = []
    dropped: list[int] = []
    for i, group in enumerate(groups):
        members = [group] if isinstance(group, TrajectoryTree) else list(group)
        if not members:
            raise ValueError(f"group {i} has no trees")
        adv = compute_advantages(members, adv_cfg)
        if adv.zero_variance and adv_cfg.zero_variance == "drop":
            dropped.append(i)
            continue
        trees.extend(members)
        tables.extend(adv.trees)
    batch = UpdateBatch.build(trees, tables, loss, version=version)
    return BatchBuild(batch, tuple(dropped))


def tree_update(
    model: PreTrainedModel,
    trajectories: Sequence[Trajectory],
    rewards: Sequence[float] | None = None,
    *,
    loss: LossConfig | None = None,
    replay: ReplayConfig | None = None,
    advantages: AdvantageConfig | None = None,
) -> TreeUpdateReport:
    """Accumulate the RL gradient of one group of trajectories into `model`'s `.grad`, by tree replay.

    The trajectories (one prompt's rollouts) are merged into one tree and normalized together. `rewards`,
    when given, replaces each trajectory's own reward, in order. `replay.contract="exact"` (the default)
    gives the conventional per-trajectory gradient; `"response_only"` the cheaper, detached approximation.
    A group whose rewards are all equal is dropped (reported, no gradient) unless
    `advantages=AdvantageConfig(zero_variance="keep")`.
    """
    from treetrain.replay.tree_replay import TreeReplay

    if rewards is not None:
        if len(rewards) != len(trajectories):
            raise ValueError(f"{len(rewards)} rewards for {len(trajectories)} trajectories")
        trajectories = [replace(t, reward=float(r)) for t, r in zip(trajectories, rewards)]
    tree = build_tree(trajectories)
    loss = loss or LossConfig()
    built = build_batch([tree], loss=loss, advantages=advantages)
    report = TreeReplay(model, loss, replay or ReplayConfig()).accumulate(built.batch)
    kept = [w.tree for w in built.batch.work]
    return TreeUpdateReport(
        replay=report,
        trees=len(kept),
        trajectories=sum(len(w.trajectories) for w in built.batch.work),
        dropped_groups=len(built.dropped_groups),
        flat_token_cost=sum(tree_stats(t).cost_flat(scoring=loss.ratio_source == "scoring") for t in kept),
    )
