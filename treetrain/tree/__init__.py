"""Trajectory trees: radix merge, statistics, file format and views."""

from treetrain.tree.build import build_tree
from treetrain.tree.stats import TreeStats, node_carries_loss, tree_stats
from treetrain.tree.trajectory_tree import (
    ROOT,
    CallRecord,
    CallRef,
    Node,
    SamplingRecord,
    TrajectoryRecord,
    TrajectoryTree,
    node_id,
)

__all__ = [
    "ROOT",
    "CallRecord",
    "CallRef",
    "Node",
    "SamplingRecord",
    "TrajectoryRecord",
    "TrajectoryTree",
    "TreeStats",
    "build_tree",
    "node_carries_loss",
    "node_id",
    "tree_stats",
]
