"""The radix tree rebuilds its input exactly, is independent of input order, survives the file format,
and assigns policy-token ownership the way `Trajectory.owned_policy_mask` states it."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from support.tree_strategies import trajectory_sets

from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree import TrajectoryTree
from treetrain.tree.build import build_tree
from treetrain.tree.format import tree_from_bytes, tree_to_bytes

TREE_SETTINGS = settings(max_examples=100, deadline=None)


@TREE_SETTINGS
@given(trajectory_sets())
def test_build_reconstructs_every_trajectory(trajs: list[Trajectory]) -> None:
    tree = build_tree(trajs)
    assert tree.trajectories() == tuple(trajs)
    assert repr(tree.trajectories()) == repr(tuple(trajs))  # bit-exact floats, -0.0 included


@TREE_SETTINGS
@given(trajectory_sets())
def test_file_round_trip_is_exact(trajs: list[Trajectory]) -> None:
    tree = build_tree(trajs)
    loaded = tree_from_bytes(tree_to_bytes(tree))
    assert loaded.trajectories() == tuple(trajs)
    assert repr(loaded.trajectories()) == repr(tuple(trajs))
    assert [n.id for n in loaded.nodes] == [n.id for n in tree.nodes]
    assert loaded.nodes == tree.nodes
    assert loaded.records == tree.records
    assert loaded.id == tree.id


@TREE_SETTINGS
@given(trajectory_sets(), st.randoms(use_true_random=False))
def test_tree_is_independent_of_input_order(trajs: list[Trajectory], rng: random.Random) -> None:
    shuffled = list(trajs)
    rng.shuffle(shuffled)
    a, b = build_tree(trajs), build_tree(shuffled)
    assert [n.id for n in a.nodes] == [n.id for n in b.nodes]
    assert [(n.tokens, n.roles, n.parent, n.offset) for n in a.nodes] == [
        (n.tokens, n.roles, n.parent, n.offset) for n in b.nodes
    ]
    assert sorted(b.trajectories(), key=lambda t: t.id) == sorted(trajs, key=lambda t: t.id)


def _positions(tree: TrajectoryTree, traj: int, call: int) -> list[tuple[int, int]]:
    """Tree positions (node, offset in node) of a call's tokens, in order."""
    end = tree.records[traj].calls[call].end
    return [(i, k) for i in tree.path(end) for k in range(len(tree.nodes[i]))]


def tree_ownership(tree: TrajectoryTree, traj: int, call: int) -> tuple[bool, ...]:
    """A policy position is owned iff no earlier call of the same trajectory passes that tree position."""
    earlier = {p for c in range(call) for p in _positions(tree, traj, c)}
    return tuple(
        tree.nodes[i].roles[k] is Role.POLICY and (i, k) not in earlier
        for i, k in _positions(tree, traj, call)
    )


@TREE_SETTINGS
@given(trajectory_sets())
def test_ownership_agrees_with_tree_structure(trajs: list[Trajectory]) -> None:
    tree = build_tree(trajs)
    for ti, traj in enumerate(trajs):
        for ci in range(len(traj.calls)):
            assert traj.owned_policy_mask(ci) == tree_ownership(tree, ti, ci)


@TREE_SETTINGS
@given(trajectory_sets())
def test_owned_policy_tokens_read_off_the_nodes(trajs: list[Trajectory]) -> None:
    tree = build_tree(trajs)
    assert tree.owned_policy_tokens() == tuple(t.num_policy_tokens for t in trajs)


@TREE_SETTINGS
@given(trajectory_sets())
def test_node_trajectory_sets_and_ends(trajs: list[Trajectory]) -> None:
    tree = build_tree(trajs)
    for node in tree.nodes[1:]:
        through = {
            ti
            for ti, t in enumerate(trajs)
            for ci in range(len(t.calls))
            if node.index in _path(tree, ti, ci)
        }
        assert node.trajectories == frozenset(through)
        assert node.ends or len(node.children) > 1  # maximal runs: leaves and single-child nodes are ends
    assert sum(len(n.ends) for n in tree.nodes) == sum(len(t.calls) for t in trajs)


def _path(tree: TrajectoryTree, traj: int, call: int) -> tuple[int, ...]:
    return tree.path(tree.records[traj].calls[call].end)


def test_ownership_example_with_rewritten_context() -> None:
    """Call 1 repeats the prompt and the first answer, then differs: only its new answer is owned."""
    prompt, answer = Segment(Role.PROMPT, (1, 2)), Segment(Role.POLICY, (3, 4))
    call0 = Call((prompt, answer, Segment(Role.OBSERVATION, (5,)), Segment(Role.POLICY, (6,))))
    call1 = Call((prompt, answer, Segment(Role.PROMPT, (9,)), Segment(Role.POLICY, (6, 7))))
    traj = Trajectory("t", (call0, call1), reward=1.0)
    expected1 = (False, False, False, False, False, True, True)
    assert traj.owned_policy_mask(1) == expected1
    assert traj.owned_policy_mask(0) == (False, False, True, True, False, True)
    assert tree_ownership(build_tree([traj]), 0, 1) == expected1
    # Negative control: the same answer under a different role is a different position, so it is owned.
    call1_obs = Call((prompt, Segment(Role.OBSERVATION, (3, 4)), Segment(Role.POLICY, (6, 7))))
    other = Trajectory("u", (call0, call1_obs), reward=1.0)
    assert other.owned_policy_mask(1) == (False, False, False, False, True, True)
    assert tree_ownership(build_tree([other]), 0, 1) == other.owned_policy_mask(1)
