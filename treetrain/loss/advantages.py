"""Advantages: GRPO group normalization, and a tree-aware variant that credits each branch point.

Both produce a `[num_trajectories, num_nodes]` table per tree: the advantage of trajectory j's policy
tokens that lie in node n. GRPO fills a row with one number; the tree mode lets a shared node carry
its own credit. Zero-variance groups are flagged so the caller drops or keeps them on purpose.

Tree mode: a node's value V(n) is the mean reward of the trajectories through it, and the value above a
tree's first real nodes is the group mean. A policy token in node n gets V(n) - V(parent(n)): the change
in expected reward that the branch taken at n's divergence point made.

Example:
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> tree = synthetic_group(prefix=8, branches=4, suffix=2, rewards=[1.0, 0.0, 0.0, 1.0])
    >>> group = compute_advantages([tree], AdvantageConfig(normalize_std=False))
    >>> group.trees[0].values[:, -1].tolist(), group.zero_variance
    ([0.5, -0.5, -0.5, 0.5], False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from treetrain.errors import ConfigError
from treetrain.tree.trajectory_tree import ROOT, TrajectoryTree

AdvantageMode = Literal["grpo", "tree"]
ZeroVariance = Literal["drop", "keep"]


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages."""

    mode: AdvantageMode = "grpo"
    """grpo: one advantage per trajectory; tree: per node, V(node) - V(parent)."""
    normalize_std: bool = True
    """Divide by the group's reward standard deviation (GRPO); False gives Dr. GRPO's mean-centering."""
    eps: float = 1e-6
    """Added to the standard deviation before dividing."""
    zero_variance: ZeroVariance = "drop"
    """A group whose rewards are all equal: drop it from the update (and from every denominator) or keep it."""

    def __post_init__(self) -> None:
        if self.mode not in ("grpo", "tree"):
            raise ConfigError(f"advantages.mode must be 'grpo' or 'tree', got {self.mode!r}")
        if self.zero_variance not in ("drop", "keep"):
            raise ConfigError(
                f"advantages.zero_variance must be 'drop' or 'keep', got {self.zero_variance!r}"
            )
        if not self.eps > 0 and self.normalize_std:
            raise ConfigError(
                f"advantages.eps must be > 0 when normalize_std is on (a zero-variance group kept with eps=0 "
                f"divides 0 by 0), got {self.eps!r}"
            )
        if not self.eps >= 0:
            raise ConfigError(f"advantages.eps must be >= 0, got {self.eps!r}")


@dataclass(frozen=True)
class TreeAdvantages:
    """Advantages of one tree: `values[j, n]` for trajectory j's policy tokens in node n."""

    tree_id: str
    values: np.ndarray  # [num_trajectories, num_nodes] float64

    def at(self, trajectory: int, node: int) -> float:
        return float(self.values[trajectory, node])


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages for every tree of a group, and whether the group had zero reward variance."""

    trees: tuple[TreeAdvantages, ...]
    zero_variance: bool
    reward_mean: float
    reward_std: float


def _node_values(tree: TrajectoryTree, rewards: np.ndarray) -> np.ndarray:
    """Mean reward of the trajectories through each node."""
    vals = np.empty(len(tree.nodes))
    for n in tree.nodes:
        vals[n.index] = rewards[sorted(n.trajectories)].mean()
    return vals


def compute_advantages(group: Sequence[TrajectoryTree], cfg: AdvantageConfig) -> GroupAdvantages:
    """Advantages for a group of trees normalized together."""
    per_tree = [np.array([r.reward for r in t.records], dtype=np.float64) for t in group]
    all_rewards = np.concatenate(per_tree)
    mean = float(all_rewards.mean())
    std = float(all_rewards.std(ddof=1)) if all_rewards.size > 1 else 0.0
    zero_var = bool(np.ptp(all_rewards) == 0.0)
    scale = (std + cfg.eps) if cfg.normalize_std else 1.0
    out: list[TreeAdvantages] = []
    for tree, rewards in zip(group, per_tree):
        n_traj, n_nodes = len(tree.records), len(tree.nodes)
        if cfg.mode == "grpo":
            adv = (rewards - mean) / scale
            table = np.repeat(adv[:, None], n_nodes, axis=1)
        else:
            vals = _node_values(tree, rewards)
            vals[ROOT] = mean
            local = np.zeros(n_nodes)
            for n in tree.nodes[1:]:
                assert n.parent is not None
                local[n.index] = (vals[n.index] - vals[n.parent]) / scale
            table = np.zeros((n_traj, n_nodes))
            for n in tree.nodes[1:]:
                table[sorted(n.trajectories), n.index] = local[n.index]
        table.setflags(write=False)
        out.append(TreeAdvantages(tree.id, table))
    return GroupAdvantages(tuple(out), zero_var, mean, std)
