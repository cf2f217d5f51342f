"""Tables for notebooks: per-node rows of one tree, and one summary row per tree (no pandas).

A `Table` holds rows of one dataclass type and renders them as markdown or HTML; in a notebook it
displays itself as HTML. `node_table` gives one `NodeRow` per real node (the empty root sentinel left out),
in pre-order: where it starts, its role runs, how many trajectories share it, whether it is a divergence
point or a leaf, whether it carries loss, and the mean reward and (given advantages) mean advantage of the
trajectories through it. `tree_table` summarises a collection of trees: shape, sharing, token ceilings.

Example:
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> table = node_table(synthetic_group(prefix=6, branches=2, suffix=2, rewards=[1.0, 0.0]))
    >>> print(table.markdown(columns=("node", "parent", "tokens", "roles", "trajectories", "divergence")))
    | node | parent | tokens | roles | trajectories | divergence |
    |---|---|---|---|---|---|
    | 1 | root | 6 | prompt×6 | 2 | yes |
    | 2 | 1 | 2 | policy×2 | 1 |  |
    | 3 | 1 | 2 | policy×2 | 1 |  |
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

from treetrain.loss.advantages import TreeAdvantages
from treetrain.tree.render import role_runs
from treetrain.tree.stats import node_carries_loss, tree_stats
from treetrain.tree.trajectory_tree import ROOT, TrajectoryTree
from treetrain.viz.nodes import node_advantages, node_mean_rewards
from treetrain.viz.tree_files import NamedTree

Row = TypeVar("Row")


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.3g}"
    return str(value)


@dataclass(frozen=True)
class Table(Generic[Row]):
    """Rows of one dataclass type; `.markdown()`, `.html()`, and rich display in notebooks.

    Columns are the row type's fields; pass `columns` to show a subset, in that order.
    """

    rows: tuple[Row, ...]
    row_type: type[Row]

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.row_type))  # type: ignore[arg-type]

    def _columns(self, columns: Sequence[str] | None) -> tuple[str, ...]:
        cols = tuple(columns) if columns is not None else self.columns
        unknown = [c for c in cols if c not in self.columns]
        if unknown:
            raise ValueError(f"unknown columns {unknown}; known: {', '.join(self.columns)}")
        return cols

    def cells(self, columns: Sequence[str] | None = None) -> list[list[str]]:
        """The table as strings, one list per row (a `parent` of 0 shows as `root`)."""
        cols = self._columns(columns)
        out = []
        for r in self.rows:
            row = []
            for c in cols:
                v = getattr(r, c)
                row.append("root" if c == "parent" and v == ROOT else _cell(v))
            out.append(row)
        return out

    def markdown(self, columns: Sequence[str] | None = None) -> str:
        cols = self._columns(columns)
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(row) + " |" for row in self.cells(cols)]
        return "\n".join(lines)

    def html(self, columns: Sequence[str] | None = None) -> str:
        cols = self._columns(columns)
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in self.cells(cols)
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def _repr_html_(self) -> str:
        return self.html()

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class NodeRow:
    """One node, as the node table shows it."""

    node: int
    """Node index in the tree."""
    parent: int
    """Parent index (0 is the empty root)."""
    depth: int
    """Nodes on the path from the root to here, this one included."""
    offset: int
    """Absolute position of the node's first token."""
    tokens: int
    roles: str
    """Role runs, e.g. `prompt×512 policy×12`."""
    trajectories: int
    """Trajectories through the node."""
    children: int
    divergence: bool
    leaf: bool
    carries_loss: bool
    """Whether some position predicts a policy token of this node."""
    versions: str
    """The weight versions that sampled the node's policy tokens, e.g. `2,3` (empty where none is recorded)."""
    ends: int
    """Calls that end exactly here."""
    mean_reward: float
    """Mean reward of the trajectories through the node."""
    advantage: float | None
    """Mean advantage of those trajectories in this node (None without advantages)."""


def node_table(tree: TrajectoryTree, advantages: TreeAdvantages | None = None) -> Table[NodeRow]:
    """The per-node table of `tree` (pre-order, root sentinel excluded)."""
    adv = node_advantages(tree, advantages) if advantages is not None else None
    rewards = node_mean_rewards(tree)
    depth = {ROOT: 0}
    rows = []
    for n in tree.nodes[1:]:
        assert n.parent is not None
        depth[n.index] = depth[n.parent] + 1
        rows.append(
            NodeRow(
                node=n.index,
                parent=n.parent,
                depth=depth[n.index],
                offset=n.offset,
                tokens=len(n),
                roles=role_runs(n.roles),
                trajectories=len(n.trajectories),
                children=len(n.children),
                divergence=n.is_divergence,
                leaf=n.is_leaf,
                carries_loss=node_carries_loss(tree, n),
                versions=",".join(map(str, tree.node_versions[n.index])),
                ends=len(n.ends),
                mean_reward=float(rewards[n.index]),
                advantage=float(adv[n.index]) if adv is not None else None,
            )
        )
    return Table(tuple(rows), NodeRow)


@dataclass(frozen=True)
class TreeRow:
    """One tree of a collection, as the summary table shows it."""

    name: str
    trajectories: int
    nodes: int
    divergence_points: int
    depth: int
    total_tokens: int
    """T: summed length of every call."""
    unique_tokens: int
    """U: tokens stored in the tree."""
    sharing: float
    """T / U."""
    ceiling_exact: float
    """Token-ceiling speedup of `exact` against flat."""
    ceiling_response_only: float
    """Token-ceiling speedup of `response_only` against flat."""


def tree_table(trees: Sequence[NamedTree]) -> Table[TreeRow]:
    """One row per tree: shape, sharing and token-ceiling speedups."""
    rows = []
    for t in trees:
        s = tree_stats(t.tree)
        rows.append(
            TreeRow(
                t.name,
                s.num_trajectories,
                s.num_nodes,
                s.num_divergence_points,
                s.depth,
                s.total_tokens,
                s.unique_tokens,
                s.sharing_ratio,
                s.ceiling_speedup_exact,
                s.ceiling_speedup_response_only,
            )
        )
    return Table(tuple(rows), TreeRow)
