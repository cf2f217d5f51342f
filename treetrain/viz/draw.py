"""Draw a tree with networkx and matplotlib: size by tokens, colour by role or advantage, divergence marked.

The layout is `tidy_layout` (top-down, leaves side by side). Each node's marker area grows with the square
root of its token count, so a 2048-token prompt is large without hiding 5-token leaves. Colour is the
node's dominant role (grey prompt, green policy, orange observation, as in the DOT export) or the mean
advantage of the trajectories through it (blue above zero, red below). Divergence points get a thick
crimson outline; leaves are labelled with the reward of the trajectories that end there.

Example:
    >>> from treetrain.tree.format import load_tree
    >>> ax = draw_tree(load_tree("trees/tool_use.msgpack"))                              # doctest: +SKIP
    >>> ax = draw_tree(tree, color_by="advantage", advantages=group.trees[0])            # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any, Literal

from treetrain.loss.advantages import TreeAdvantages
from treetrain.trajectory import Role
from treetrain.tree.graph import to_networkx
from treetrain.tree.render import ROLE_COLOURS
from treetrain.tree.trajectory_tree import ROOT, TrajectoryTree
from treetrain.viz._mpl import pyplot
from treetrain.viz.layout import Vertical, tidy_layout
from treetrain.viz.nodes import node_advantages

ColorBy = Literal["role", "advantage"]
DIVERGENCE_COLOUR = "crimson"


LABEL_SIZE = 7.0
"""Font size of the leaf labels, in points."""
LABEL_LINE = 1.3 * LABEL_SIZE
"""How much lower every other leaf's label sits (points): neighbouring labels then never share a line."""


def reward_label(rewards: list[float]) -> str:
    """A leaf's label: its distinct rewards rounded to two decimals (`r=0.12`, `r=0,1`); more than two
    distinct values read as their range and count (`r=0.1..0.9 (5)`), so a label stays short.

    Example:
        >>> reward_label([0.123456789]), reward_label([1.0, 0.0, 1.0]), reward_label([0.1, 0.5, 0.25, 0.9])
        ('r=0.12', 'r=0,1', 'r=0.1..0.9 (4)')
    """
    vals = sorted({round(v, 2) for v in rewards})
    shown = [f"{v:.2f}".rstrip("0").rstrip(".") if math.isfinite(v) else str(v) for v in vals]
    shown = ["0" if t == "-0" else t for t in shown]
    return f"r={shown[0]}..{shown[-1]} ({len(vals)})" if len(vals) > 2 else "r=" + ",".join(shown)


def node_sizes(tree: TrajectoryTree, smallest: float = 60.0, largest: float = 1400.0) -> list[float]:
    """Marker areas (points^2) per node: `smallest` + (`largest` - `smallest`) * sqrt(tokens / most)."""
    most = max((len(n) for n in tree.nodes), default=0) or 1
    return [smallest + (largest - smallest) * math.sqrt(len(n) / most) for n in tree.nodes]


def dominant_roles(tree: TrajectoryTree) -> list[Role]:
    """The role holding most of each node's tokens (ties: prompt, then policy, then observation)."""
    out = []
    for n in tree.nodes:
        counts = {r: n.roles.count(r) for r in (Role.PROMPT, Role.POLICY, Role.OBSERVATION)}
        out.append(max(counts, key=lambda r: counts[r]) if n.roles else Role.PROMPT)
    return out


def draw_tree(
    tree: TrajectoryTree,
    *,
    color_by: ColorBy = "role",
    advantages: TreeAdvantages | None = None,
    ax: Any = None,
    vertical: Vertical = "depth",
    labels: bool = True,
    rewards: bool = True,
    title: str | None = None,
) -> Any:
    """Draw `tree` on `ax` (a new figure if None) and return the axes.

    `color_by="advantage"` needs `advantages` (one tree's table from `compute_advantages`).
    `vertical="tokens"` places each node at the position where it ends, so edge lengths show node lengths.
    """
    import networkx as nx

    plt = pyplot()
    if color_by not in ("role", "advantage"):
        raise ValueError(f"color_by must be 'role' or 'advantage', got {color_by!r}")
    if color_by == "advantage" and advantages is None:
        raise ValueError(
            "color_by='advantage' needs the tree's advantages (compute_advantages(...).trees[i])"
        )
    if ax is None:
        leaves = max(1, len(tree.leaves()))
        _, ax = plt.subplots(figsize=(min(16.0, 2.0 + 0.55 * leaves), 4.5))
    graph = to_networkx(tree)
    pos = tidy_layout(tree, vertical=vertical)
    nodes = [n.index for n in tree.nodes if n.index != ROOT]
    sizes = node_sizes(tree)
    mappable = None
    if color_by == "role":
        roles = dominant_roles(tree)
        colours: list[Any] = [ROLE_COLOURS[roles[i]] for i in nodes]
        kwargs: dict[str, Any] = {}
    else:
        assert advantages is not None
        adv = node_advantages(tree, advantages)
        colours = [float(adv[i]) for i in nodes]
        bound = max(1e-9, max((abs(c) for c in colours), default=0.0))
        kwargs = {"cmap": plt.get_cmap("RdBu"), "vmin": -bound, "vmax": bound}
    edge_colours = [DIVERGENCE_COLOUR if tree.nodes[i].is_divergence else "#444444" for i in nodes]
    widths = [2.8 if tree.nodes[i].is_divergence else 0.8 for i in nodes]
    nx.draw_networkx_edges(graph, pos, ax=ax, arrows=False, edge_color="#999999", width=1.0)
    nx.draw_networkx_nodes(graph, pos, nodelist=[ROOT], node_size=25, node_color="black", ax=ax)
    mappable = nx.draw_networkx_nodes(
        graph, pos, nodelist=nodes, node_size=[sizes[i] for i in nodes], node_color=colours,
        edgecolors=edge_colours, linewidths=widths, ax=ax, **kwargs,
    )  # fmt: skip
    if labels:
        nx.draw_networkx_labels(graph, pos, labels={i: str(i) for i in nodes}, font_size=7, ax=ax)
    if rewards:
        ended = sorted((i for i in tree.leaves() if tree.nodes[i].ends), key=lambda i: pos[i])
        for k, i in enumerate(ended):
            text = reward_label([tree.records[r.trajectory].reward for r in tree.nodes[i].ends])
            x, y = pos[i]
            # marker radius in points plus a gap; every other leaf one line lower, so neighbours never overlap
            below = math.sqrt(sizes[i]) / 2 + 6 + (LABEL_LINE if k % 2 else 0.0)
            ax.annotate(
                text, (x, y), xytext=(0, -below), textcoords="offset points", ha="center", va="top",
                fontsize=LABEL_SIZE,
            )  # fmt: skip
    _legend(ax, color_by, mappable, plt)
    ys = [y for _, y in pos.values()]
    pad = 0.6 if vertical == "depth" else 0.08 * (max(ys) - min(ys) or 1.0)
    ax.set_ylim(min(ys) - pad, max(ys) + pad)
    xs = [x for x, _ in pos.values()]
    ax.set_xlim(min(xs) - 0.8, max(xs) + 0.8)
    ax.set_ylabel("depth" if vertical == "depth" else "token position")
    if vertical == "tokens":
        ax.tick_params(left=True, labelleft=True)
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{abs(v):g}"))
    ax.set_xticks([])
    if vertical == "depth":
        ax.set_yticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title if title is not None else f"tree {tree.id[:12]}: {len(tree.records)} trajectories")
    return ax


def _legend(ax: Any, color_by: ColorBy, mappable: Any, plt: Any) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D(
            [],
            [],
            marker="o",
            ls="",
            mfc="white",
            mec=DIVERGENCE_COLOUR,
            mew=2.5,
            ms=9,
            label="divergence point",
        )
    ]
    if color_by == "role":
        handles = [
            Line2D([], [], marker="o", ls="", mfc=ROLE_COLOURS[r], mec="#444444", ms=9, label=r.value)
            for r in (Role.PROMPT, Role.POLICY, Role.OBSERVATION)
        ] + handles
    else:
        plt.colorbar(mappable, ax=ax, shrink=0.8, label="mean advantage of trajectories through node")
    ax.legend(handles=handles, loc="upper right", fontsize=7, frameon=False)
