"""A tidy top-down layout for a tree, computed here so drawing needs no graphviz.

Leaves take consecutive horizontal slots in depth-first order; a parent sits midway between its first
and last child, so no two subtrees overlap and edges never cross. The vertical axis is either the depth
(one level per node) or the token position where the node ends, which shows how long each node is.

Example:
    >>> from treetrain.trajectory import Call, Role, Segment, Trajectory
    >>> from treetrain.tree.build import build_tree
    >>> def traj(i, resp):
    ...     return Trajectory(f"t{i}", (Call((Segment(Role.PROMPT, (1, 2)), Segment(Role.POLICY, resp))),), 0.0)
    >>> tree = build_tree([traj(0, (7,)), traj(1, (8,))])
    >>> tidy_layout(tree)
    {0: (0.5, 0.0), 1: (0.5, -1.0), 2: (0.0, -2.0), 3: (1.0, -2.0)}
"""

from __future__ import annotations

from typing import Literal

from treetrain.tree.trajectory_tree import ROOT, TrajectoryTree

Vertical = Literal["depth", "tokens"]


def tidy_layout(
    tree: TrajectoryTree, *, vertical: Vertical = "depth", include_root: bool = True
) -> dict[int, tuple[float, float]]:
    """Node index -> (x, y), y pointing down (negative). `vertical="tokens"` puts a node at -(its end).

    Leaves are one unit apart; with `include_root=False` the empty root sentinel is left out.
    """
    if vertical not in ("depth", "tokens"):
        raise ValueError(f"vertical must be 'depth' or 'tokens', got {vertical!r}")
    x: dict[int, float] = {}
    depth: dict[int, int] = {ROOT: 0}
    next_slot = 0.0
    for idx in tree.postorder():  # children first: leaves get slots left to right
        node = tree.nodes[idx]
        if node.children:
            x[idx] = (x[node.children[0]] + x[node.children[-1]]) / 2
        else:
            x[idx] = next_slot
            next_slot += 1.0
    for node in tree.nodes[1:]:  # pre-order: parents before children
        assert node.parent is not None
        depth[node.index] = depth[node.parent] + 1
    pos: dict[int, tuple[float, float]] = {}
    for node in tree.nodes:
        if node.index == ROOT and not include_root:
            continue
        y = float(-depth[node.index]) if vertical == "depth" else float(-node.end)
        pos[node.index] = (x[node.index], y)
    return dict(sorted(pos.items()))
