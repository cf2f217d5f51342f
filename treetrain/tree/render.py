"""Human views of a tree: an indented terminal outline and a Graphviz DOT export.

The outline has one line per node: its index, its role runs (`prompt×512 policy×12`), its tokens with
long runs collapsed (`[1 2 3 … 98 99]`, or decoded text when a tokenizer is given), how many trajectories
pass through it, the weight versions that sampled its policy tokens (`v2,3`, when recorded), a `◆` mark at
divergence points and, where calls end, the trajectory ids and rewards. The summary line ends with the
sampling settings when the tree records them.

Example:
    >>> from treetrain.trajectory import Call, Role, Segment, Trajectory
    >>> def traj(i, resp):
    ...     call = Call((Segment(Role.PROMPT, tuple(range(1, 100))), Segment(Role.POLICY, resp)))
    ...     return Trajectory(f"t{i}", (call,), reward=float(i))
    >>> from treetrain.tree.build import build_tree
    >>> tree = build_tree([traj(0, (7, 8)), traj(1, (7, 9))])
    >>> print("\\n".join(render_tree(tree, RenderOptions(max_tokens=5)).splitlines()[1:]))
    root  2 traj
    └── #1 prompt×99 policy×1  [1 2 3 … 99 7]  2 traj  ◆ 2 branches
        ├── #2 policy×1  [8]  1 traj  ■ t0 reward=0
        └── #3 policy×1  [9]  1 traj  ■ t1 reward=1
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

from treetrain.io import path_problem
from treetrain.trajectory import Role
from treetrain.tree.stats import tree_stats
from treetrain.tree.trajectory_tree import ROOT, Node, TrajectoryTree

Decoder = Callable[[Sequence[int]], str]

ROLE_COLOURS = {Role.PROMPT: "#d0d7de", Role.POLICY: "#9be9a8", Role.OBSERVATION: "#ffd59e"}
"""DOT fill colour per role: grey prompt, green policy, orange observation."""


@dataclass(frozen=True)
class RenderOptions:
    """How much of each node to show."""

    max_tokens: int = 8
    """Token ids (or tokens decoded to text) shown per node; longer runs keep the head and tail."""
    max_role_runs: int = 4
    """Role runs listed per node before the rest are summarised as `+N runs`."""
    decode: Decoder | None = None
    """Turns token ids into text; when set, snippets show text instead of ids."""

    def __post_init__(self) -> None:
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {self.max_tokens}")
        if self.max_role_runs < 1:
            raise ValueError(f"max_role_runs must be at least 1, got {self.max_role_runs}")


def role_runs(roles: Sequence[Role], max_runs: int = 4) -> str:
    """Run-length summary of roles, e.g. `prompt×512 policy×12`."""
    runs = [f"{role.value}×{len(list(group))}" for role, group in groupby(roles)]
    if len(runs) > max_runs:
        runs = [*runs[:max_runs], f"+{len(runs) - max_runs} runs"]
    return " ".join(runs)


def token_snippet(tokens: Sequence[int], options: RenderOptions) -> str:
    """The node's tokens, head and tail only when there are more than `options.max_tokens`."""
    n, limit = len(tokens), options.max_tokens
    head, tail = (tokens, ()) if n <= limit else (tokens[: (limit + 1) // 2], tokens[n - limit // 2 :])
    if options.decode is not None:
        text = _quote(options.decode(head))
        return text if not tail else f"{text} … {_quote(options.decode(tail))}"
    ids = " ".join(map(str, head))
    return f"[{ids}]" if not tail else f"[{ids} … {' '.join(map(str, tail))}]"


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _ends(tree: TrajectoryTree, node: Node) -> str:
    parts = []
    for ref in node.ends:
        rec = tree.records[ref.trajectory]
        call = f" call {ref.call}" if len(rec.calls) > 1 else ""
        parts.append(f"{rec.id}{call} reward={rec.reward:g}")
    return "■ " + ", ".join(parts) if parts else ""


def version_label(versions: Sequence[int]) -> str:
    """The weight versions that sampled a node's policy tokens, e.g. `v3` or `v2,3`."""
    return "v" + ",".join(map(str, versions))


def node_label(tree: TrajectoryTree, node: Node, options: RenderOptions) -> str:
    """One-line description of a node, without the tree drawing."""
    if node.index == ROOT:
        parts = ["root"]
    else:
        runs = role_runs(node.roles, options.max_role_runs)
        parts = [f"#{node.index} {runs}", token_snippet(node.tokens, options)]
    parts.append(f"{len(node.trajectories)} traj")
    if versions := tree.node_versions[node.index]:
        parts.append(version_label(versions))
    if node.is_divergence:
        parts.append(f"◆ {len(node.children)} branches")
    if node.ends:
        parts.append(_ends(tree, node))
    return "  ".join(parts)


def render_tree(tree: TrajectoryTree, options: RenderOptions | None = None) -> str:
    """Indented outline: a summary line, then one line per node in pre-order."""
    options = options or RenderOptions()
    s = tree_stats(tree)
    lines = [
        f"tree {tree.id[:12]}  nodes={s.num_nodes} trajectories={s.num_trajectories} calls={s.num_calls} "
        f"leaves={s.num_leaves} divergence_points={s.num_divergence_points} depth={s.depth} "
        f"T={s.total_tokens} U={s.unique_tokens} sharing={s.sharing_ratio:.2f}x "
        f"ceiling_speedup_exact={s.ceiling_speedup_exact:.2f}x"
        + (f"  sampled at {tree.sampling.describe()}" if tree.sampling is not None else "")
    ]
    # (node, prefix for its own line, prefix for its children's lines); iterative for deep trees.
    stack: list[tuple[int, str, str]] = [(ROOT, "", "")]
    while stack:
        index, lead, child_lead = stack.pop()
        node = tree.nodes[index]
        lines.append(lead + node_label(tree, node, options))
        kids = node.children
        for k in reversed(range(len(kids))):
            last = k == len(kids) - 1
            stack.append(
                (
                    kids[k],
                    child_lead + ("└── " if last else "├── "),
                    child_lead + ("    " if last else "│   "),
                )
            )
    return "\n".join(lines)


def render_trees(trees: Sequence[TrajectoryTree], options: RenderOptions | None = None) -> str:
    """Outline of every tree of a group, separated by blank lines."""
    if len(trees) == 1:
        return render_tree(trees[0], options)
    return "\n\n".join(f"[{k + 1}/{len(trees)}] {render_tree(t, options)}" for k, t in enumerate(trees))


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fill(node: Node) -> tuple[str, str]:
    """(style, fillcolor): one colour for single-role nodes, stripes sized by role share otherwise."""
    if not node.roles:
        return "filled", "#ffffff"
    counts = {r: node.roles.count(r) for r in Role if r in node.roles}
    if len(counts) == 1:
        return "filled", ROLE_COLOURS[next(iter(counts))]
    total = len(node.roles)
    return "striped", ":".join(f"{ROLE_COLOURS[r]};{c / total:.3f}" for r, c in counts.items())


def to_dot(trees: Sequence[TrajectoryTree], options: RenderOptions | None = None) -> str:
    """Graphviz DOT for a group; one cluster per tree when there are several. Colour encodes role."""
    options = options or RenderOptions()
    out = [
        "digraph treetrain {",
        '  node [shape=box, fontname="monospace", fontsize=10];',
        "  // fill: "
        + ", ".join(f"{r.value} {c}" for r, c in ROLE_COLOURS.items())
        + "; double border: divergence",
    ]
    for k, tree in enumerate(trees):
        indent = "  "
        if len(trees) > 1:
            out.append(f'  subgraph cluster_{k} {{\n    label="{tree.id[:12]}";')
            indent = "    "
        for node in tree.nodes:
            if node.index == ROOT:
                text = f"root\\n{tree.id[:12]}"
            else:
                runs = role_runs(node.roles, options.max_role_runs)
                text = "\\n".join(
                    _dot_escape(x) for x in (f"#{node.index} {runs}", token_snippet(node.tokens, options))
                )
            text += _dot_escape(f"\n{len(node.trajectories)} traj")
            if versions := tree.node_versions[node.index]:
                text += _dot_escape(f" {version_label(versions)}")
            if node.ends:
                text += _dot_escape("\n" + _ends(tree, node))
            style, fill = _fill(node)
            extra = ", peripheries=2" if node.is_divergence else ""
            out.append(
                f'{indent}t{k}n{node.index} [label="{text}", style="{style}", fillcolor="{fill}"{extra}];'
            )
            if node.parent is not None:
                out.append(f"{indent}t{k}n{node.parent} -> t{k}n{node.index};")
        if len(trees) > 1:
            out.append("  }")
    out.append("}")
    return "\n".join(out) + "\n"


def tokenizer_decoder(directory: str) -> Decoder:
    """A decoder backed by a local Hugging Face tokenizer directory (no network). Raises `ValueError`
    naming the problem for a path that is not a directory (Hugging Face would take it for a repo id)."""
    problem = path_problem(directory, "directory")
    if problem is not None:
        raise ValueError(problem)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode
