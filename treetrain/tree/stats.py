"""Tree statistics and the token-ceiling cost model (docs/design.md, "Cost model: the token ceiling").

Per token a forward costs 1 and a backward 2; attention's quadratic term is ignored. With T the summed
sequence lengths, U the unique tokens, U_ctx the unique tokens of nodes that carry no loss (neither on
their own positions nor on their last position; see `node_carries_loss`), U_int / U_leaf the unique tokens of internal / leaf nodes:

    flat                          3·T
    response_only                 U_ctx + 3·(U − U_ctx)
    exact (internal recomputed)   4·U_int + 3·U_leaf
    exact (internal graphs kept)  3·U

A scoring pass adds T to flat and U to the tree modes. Speedup is flat's cost over the mode's.

Example:
    >>> from treetrain.trajectory import Call, Role, Segment, Trajectory
    >>> prompt = Segment(Role.PROMPT, tuple(range(100)))
    >>> trajs = [Trajectory(f"t{g}", (Call((prompt, Segment(Role.POLICY, (200 + g,) * 10))),), 0.0)
    ...          for g in range(4)]
    >>> from treetrain.tree.build import build_tree
    >>> s = tree_stats(build_tree(trajs))
    >>> s.total_tokens, s.unique_tokens, round(s.ceiling_speedup_exact, 3)
    (440, 140, 2.538)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from treetrain.trajectory import Role
from treetrain.tree.trajectory_tree import ROOT, Node, TrajectoryTree


@dataclass(frozen=True)
class TreeStats:
    """Shape and token-ceiling costs of one tree. All counts are tokens unless named otherwise."""

    num_trajectories: int
    num_calls: int
    num_nodes: int
    num_leaves: int
    num_divergence_points: int
    depth: int
    """Most nodes on one root-to-leaf path (the empty root not counted)."""
    max_sequence_length: int
    total_tokens: int
    """T: summed length of every call."""
    unique_tokens: int
    """U: tokens stored in the tree."""
    policy_tokens: int
    """Policy tokens over all calls (a shared policy token counts once per call through it)."""
    unique_policy_tokens: int
    context_tokens: int
    """U_ctx: unique tokens in nodes that carry no loss."""
    internal_tokens: int
    """U_int."""
    leaf_tokens: int
    """U_leaf."""
    branching_histogram: tuple[tuple[int, int], ...]
    """(number of children, number of nodes with that many), for every node with children."""

    @property
    def sharing_ratio(self) -> float:
        return self.total_tokens / self.unique_tokens if self.unique_tokens else 1.0

    def cost_flat(self, scoring: bool = False) -> int:
        return 3 * self.total_tokens + (self.total_tokens if scoring else 0)

    def cost_response_only(self, scoring: bool = False) -> int:
        u, ctx = self.unique_tokens, self.context_tokens
        return ctx + 3 * (u - ctx) + (u if scoring else 0)

    def cost_exact(self, scoring: bool = False, keep_internal_graphs: bool = False) -> int:
        base = (
            3 * self.unique_tokens
            if keep_internal_graphs
            else 4 * self.internal_tokens + 3 * self.leaf_tokens
        )
        return base + (self.unique_tokens if scoring else 0)

    @property
    def ceiling_speedup_exact(self) -> float:
        return self.cost_flat() / max(1, self.cost_exact())

    @property
    def ceiling_speedup_response_only(self) -> float:
        return self.cost_flat() / max(1, self.cost_response_only())

    def as_dict(self) -> dict[str, object]:
        """JSON-ready view including the derived costs."""
        from dataclasses import asdict

        d: dict[str, object] = asdict(self)
        d["branching_histogram"] = {str(k): v for k, v in self.branching_histogram}
        d["sharing_ratio"] = self.sharing_ratio
        d["cost"] = {
            "flat": self.cost_flat(),
            "response_only": self.cost_response_only(),
            "exact": self.cost_exact(),
            "exact_keep_graphs": self.cost_exact(keep_internal_graphs=True),
            "flat_scored": self.cost_flat(True),
            "response_only_scored": self.cost_response_only(True),
            "exact_scored": self.cost_exact(True),
        }
        d["ceiling_speedup"] = {
            "exact": self.ceiling_speedup_exact,
            "exact_keep_graphs": self.cost_flat() / max(1, self.cost_exact(keep_internal_graphs=True)),
            "response_only": self.ceiling_speedup_response_only,
        }
        return d


def node_carries_loss(tree: TrajectoryTree, node: Node) -> bool:
    """Whether the node holds a policy token that some position predicts.

    Replay feeds each node with its parent's last token in front, so the prediction of a node's first token
    belongs to the node, not to its parent: a prompt node followed by responses carries no loss, and the
    `response_only` cost of one prompt of P tokens with G responses of S tokens is P + 3GS (docs/design.md).
    Only a sequence's very first token is never predicted.
    """
    first = 1 if node.parent == ROOT else 0
    return any(r is Role.POLICY for r in node.roles[first:])


def tree_stats(tree: TrajectoryTree) -> TreeStats:
    real = [n for n in tree.nodes if n.index != ROOT]
    # Per node, the policy tokens on its root path: T and the flat policy count come from call ends in
    # time linear in the nodes and calls, never in T (shared prefixes make T far larger than the tree).
    path_policy = [0] * len(tree.nodes)
    for n in tree.nodes[1:]:
        assert n.parent is not None
        path_policy[n.index] = path_policy[n.parent] + sum(1 for r in n.roles if r is Role.POLICY)
    ends = [tree.call_end(ref) for ref in tree.call_refs()]
    total = sum(tree.nodes[e].end for e in ends)
    policy = sum(path_policy[e] for e in ends)
    depth_of = {ROOT: 0}
    for n in tree.nodes[1:]:
        assert n.parent is not None
        depth_of[n.index] = depth_of[n.parent] + 1
    hist = Counter(len(n.children) for n in tree.nodes if n.children)
    return TreeStats(
        num_trajectories=len(tree.records),
        num_calls=len(tree.call_refs()),
        num_nodes=len(real),
        num_leaves=sum(1 for n in real if n.is_leaf),
        num_divergence_points=len(tree.divergence_points()),
        depth=max(depth_of.values()),
        max_sequence_length=max((n.end for n in real), default=0),
        total_tokens=total,
        unique_tokens=sum(len(n) for n in real),
        policy_tokens=policy,
        unique_policy_tokens=sum(1 for n in real for r in n.roles if r is Role.POLICY),
        context_tokens=sum(len(n) for n in real if not node_carries_loss(tree, n)),
        internal_tokens=sum(len(n) for n in real if not n.is_leaf),
        leaf_tokens=sum(len(n) for n in real if n.is_leaf),
        branching_histogram=tuple(sorted(hist.items())),
    )
