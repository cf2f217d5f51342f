"""Per-node numbers derived from per-trajectory data: mean advantage and mean reward of a node.

`compute_advantages` gives a `[num_trajectories, num_nodes]` table (`TreeAdvantages.values`): the advantage
of trajectory j's policy tokens in node n. A node shared by several trajectories carries all of their
advantages; for a picture it gets one number, their mean over the trajectories through it. Under GRPO
that is the mean advantage of the node's subtree; under tree advantages every entry of a column is equal.

Example:
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> from treetrain.loss.advantages import AdvantageConfig, compute_advantages
    >>> tree = synthetic_group(prefix=8, branches=2, suffix=2, rewards=[1.0, 0.0])
    >>> adv = compute_advantages([tree], AdvantageConfig(normalize_std=False)).trees[0]
    >>> node_advantages(tree, adv).round(2).tolist()
    [0.0, 0.0, -0.5, 0.5]
"""

from __future__ import annotations

import numpy as np

from treetrain.loss.advantages import TreeAdvantages
from treetrain.tree.trajectory_tree import TrajectoryTree


def node_advantages(tree: TrajectoryTree, advantages: TreeAdvantages) -> np.ndarray:
    """Mean advantage over the trajectories through each node, `[num_nodes]` (the root: over all)."""
    if advantages.tree_id != tree.id:
        raise ValueError(f"advantages are for tree {advantages.tree_id[:12]}, not tree {tree.id[:12]}")
    values = advantages.values  # [num_trajectories, num_nodes]
    if values.shape != (len(tree.records), len(tree.nodes)):
        raise ValueError(
            f"advantage table has shape {values.shape}, expected "
            f"({len(tree.records)} trajectories, {len(tree.nodes)} nodes)"
        )
    out = np.zeros(len(tree.nodes))
    for n in tree.nodes:
        through = sorted(n.trajectories)
        out[n.index] = float(values[through, n.index].mean()) if through else 0.0
    return out


def node_mean_rewards(tree: TrajectoryTree) -> np.ndarray:
    """Mean reward of the trajectories through each node, `[num_nodes]`."""
    rewards = np.array([r.reward for r in tree.records], dtype=np.float64)
    return np.array(
        [float(rewards[sorted(n.trajectories)].mean()) if n.trajectories else np.nan for n in tree.nodes]
    )
