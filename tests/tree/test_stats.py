"""Tree statistics agree with a brute-force count over the input sequences and with the networkx export,
and the doctest examples of the core modules run."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
from collections import Counter
from collections.abc import Sequence

import networkx as nx
import pytest
from hypothesis import given, settings
from support.tree_strategies import trajectory_sets

from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree import TreeStats
from treetrain.tree.build import build_tree
from treetrain.tree.graph import to_networkx
from treetrain.tree.stats import tree_stats

Pair = tuple[int, Role]
Prefix = tuple[Pair, ...]


def brute_force_stats(trajs: Sequence[Trajectory]) -> TreeStats:
    """Every statistic from the set of (token, role) prefixes of the calls, without building a tree.

    A tree position is a distinct non-empty prefix. A node ends at a prefix where a call ends or where
    continuations part ways; its positions run from the previous such boundary on the same path.
    """
    seqs: list[Prefix] = [tuple(zip(c.tokens, c.roles)) for t in trajs for c in t.calls]
    prefixes = {s[:k] for s in seqs for k in range(len(s) + 1)}
    next_pairs: dict[Prefix, set[Pair]] = {p: set() for p in prefixes}
    for s in seqs:
        for k in range(len(s)):
            next_pairs[s[:k]].add(s[k])
    full = set(seqs)
    boundaries = {p for p in prefixes if p and (p in full or len(next_pairs[p]) > 1)}

    node_of: dict[Prefix, Prefix] = {}  # position -> the boundary closing its node
    depth = 0
    for s in seqs:
        ends = [k for k in range(1, len(s) + 1) if s[:k] in boundaries]
        depth = max(depth, len(ends))
        start = 0
        for k in ends:
            for j in range(start + 1, k + 1):
                node_of[s[:j]] = s[:k]
            start = k
    positions = [p for p in prefixes if p]
    is_leaf = {b: not next_pairs[b] for b in boundaries}
    carries_loss = {b: False for b in boundaries}
    for p in positions:  # a policy token carries loss in its own node unless it starts a sequence
        if p[-1][1] is Role.POLICY and len(p) > 1:
            carries_loss[node_of[p]] = True
    branching = Counter(len(next_pairs[p]) for p in boundaries | {()} if next_pairs[p])
    return TreeStats(
        num_trajectories=len(trajs),
        num_calls=len(seqs),
        num_nodes=len(boundaries),
        num_leaves=sum(is_leaf.values()),
        num_divergence_points=sum(1 for p in boundaries | {()} if len(next_pairs[p]) > 1),
        depth=depth,
        max_sequence_length=max(len(s) for s in seqs),
        total_tokens=sum(len(s) for s in seqs),
        unique_tokens=len(positions),
        policy_tokens=sum(1 for s in seqs for _, r in s if r is Role.POLICY),
        unique_policy_tokens=sum(1 for p in positions if p[-1][1] is Role.POLICY),
        context_tokens=sum(1 for p in positions if not carries_loss[node_of[p]]),
        internal_tokens=sum(1 for p in positions if not is_leaf[node_of[p]]),
        leaf_tokens=sum(1 for p in positions if is_leaf[node_of[p]]),
        branching_histogram=tuple(sorted(branching.items())),
    )


def networkx_mismatches(stats: TreeStats, g: nx.DiGraph) -> list[str]:
    real = [n for n, d in g.nodes(data=True) if not d["is_root"]]
    tokens = {n: g.nodes[n]["num_tokens"] for n in real}
    checks = {
        "num_nodes": len(real),
        "num_leaves": sum(1 for n in real if g.out_degree(n) == 0),
        "num_divergence_points": sum(1 for n in g if g.out_degree(n) > 1),
        "depth": nx.dag_longest_path_length(g),
        "unique_tokens": sum(tokens.values()),
        "context_tokens": sum(t for n, t in tokens.items() if not g.nodes[n]["carries_loss"]),
        "internal_tokens": sum(t for n, t in tokens.items() if g.out_degree(n) > 0),
        "leaf_tokens": sum(t for n, t in tokens.items() if g.out_degree(n) == 0),
        "unique_policy_tokens": sum(g.nodes[n]["roles"].get("policy", 0) for n in real),
    }
    return [
        f"{k}: stats {getattr(stats, k)} != graph {v}" for k, v in checks.items() if getattr(stats, k) != v
    ]


@settings(max_examples=100, deadline=None)
@given(trajectory_sets())
def test_stats_match_brute_force_and_networkx(trajs: list[Trajectory]) -> None:
    tree = build_tree(trajs)
    stats = tree_stats(tree)
    assert stats == brute_force_stats(trajs)
    assert networkx_mismatches(stats, to_networkx(tree)) == []


def test_checks_catch_a_wrong_statistic() -> None:
    """Negative control: a statistic that is off by one is caught by both references."""
    prompt = Segment(Role.PROMPT, (1, 2, 3))
    trajs = [Trajectory(f"t{g}", (Call((prompt, Segment(Role.POLICY, (10 + g,)))),), 0.0) for g in range(3)]
    tree = build_tree(trajs)
    for field in ("context_tokens", "internal_tokens", "depth", "num_divergence_points"):
        wrong = dataclasses.replace(tree_stats(tree), **{field: getattr(tree_stats(tree), field) + 1})
        assert wrong != brute_force_stats(trajs)
        assert networkx_mismatches(wrong, to_networkx(tree))


@pytest.mark.parametrize(("p", "g", "s"), [(100, 4, 10), (7, 1, 3), (1, 5, 2)])
def test_design_doc_example_costs(p: int, g: int, s: int) -> None:
    """docs/design.md: one prompt of P tokens and G responses of S tokens."""
    prompt = Segment(Role.PROMPT, tuple(range(p)))
    trajs = [
        Trajectory(f"t{i}", (Call((prompt, Segment(Role.POLICY, (1000 + i,) * s))),), 0.0) for i in range(g)
    ]
    stats = tree_stats(build_tree(trajs))
    branched = g > 1
    assert stats.cost_flat() == 3 * g * (p + s)
    # Replay feeds each response with the prompt's last token in front, so the prompt node carries no loss
    # of its own and response_only costs P + 3GS (the worked example of docs/design.md). With one trajectory there is a
    # single node, and it carries loss.
    assert stats.context_tokens == (p if branched else 0)
    assert stats.cost_response_only() == (p + 3 * g * s if branched else 3 * (p + s))
    assert stats.cost_exact() == (4 * p + 3 * g * s if branched else 3 * (p + s))
    assert stats.cost_exact(keep_internal_graphs=True) == 3 * p + 3 * g * s


DOCTEST_MODULES = [
    "treetrain.trajectory",
    "treetrain.tree.trajectory_tree",
    "treetrain.tree.build",
    "treetrain.tree.stats",
    "treetrain.tree.graph",
    "treetrain.tree.format",
    "treetrain.tree.render",
]


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    if name not in ("treetrain.tree.build", "treetrain.tree.graph"):  # the two without examples
        assert result.attempted > 0
