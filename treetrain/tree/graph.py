"""networkx export of a tree, for drawing and for independent checks of the statistics."""

from __future__ import annotations

from collections import Counter

import networkx as nx

from treetrain.trajectory import Role
from treetrain.tree.stats import node_carries_loss
from treetrain.tree.trajectory_tree import TrajectoryTree


def to_networkx(tree: TrajectoryTree) -> nx.DiGraph:
    """A DiGraph keyed by node index; edges point parent -> child.

    Node attributes: `id`, `num_tokens`, `offset`, `roles` (count per role name), `dominant_role`,
    `num_trajectories`, `is_divergence`, `is_leaf`, `is_root`, `carries_loss`, `ends` (call refs as
    "traj:call" strings) and `rewards` (rewards of the trajectories ending here).
    """
    g = nx.DiGraph(tree_id=tree.id)
    for n in tree.nodes:
        counts = Counter(r.value for r in n.roles)
        dominant = counts.most_common(1)[0][0] if counts else Role.PROMPT.value
        g.add_node(
            n.index,
            id=n.id,
            num_tokens=len(n),
            offset=n.offset,
            roles=dict(counts),
            dominant_role=dominant,
            num_trajectories=len(n.trajectories),
            is_divergence=n.is_divergence,
            is_leaf=n.is_leaf and n.index != 0,
            is_root=n.parent is None,
            carries_loss=n.parent is not None and node_carries_loss(tree, n),
            ends=[f"{r.trajectory}:{r.call}" for r in n.ends],
            rewards=[tree.records[r.trajectory].reward for r in n.ends],
        )
        if n.parent is not None:
            g.add_edge(n.parent, n.index)
    return g
