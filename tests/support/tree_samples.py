"""Shared samples for the tree file tests: a tiny tree covering every field, and a load checker."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack
import pytest

from treetrain.trajectory import Call, Role, Segment, Trajectory, TrajectoryMeta
from treetrain.tree import SamplingRecord, TrajectoryTree
from treetrain.tree.build import build_tree
from treetrain.tree.format import TreeFormatError, tree_to_bytes, trees_from_bytes, trees_to_bytes


def tiny_tree() -> TrajectoryTree:
    """The tree in tests/assets/tree_tiny.msgpack.

    Nodes: 0 root; 1 prompt×3 policy×1 (diverges); 2 policy (22) (diverges at a tool result);
    3 observation+policy, leaf of "a"; 4 observation+policy, leaf of "c"; 5 policy (23), leaf of "b".
    """
    prompt = Segment(Role.PROMPT, (11, 12, 13))
    meta = TrajectoryMeta("tiny", 7, 3, {"task": "x"})

    def episode(tool: int, answer: int) -> Call:
        turn1 = Segment(Role.POLICY, (21, 22), (-0.25, -1.5))
        return Call(
            (prompt, turn1, Segment(Role.OBSERVATION, (tool,)), Segment(Role.POLICY, (answer,), (-0.125,)))
        )

    return build_tree(
        [
            Trajectory("a", (episode(31, 41),), reward=1.0, step_rewards=(0.5, 1.0), meta=meta),
            Trajectory("b", (Call((prompt, Segment(Role.POLICY, (21, 23)))),), reward=-0.5),
            Trajectory("c", (episode(32, 42),), reward=0.0),
        ]
    )


TINY_BYTES = tree_to_bytes(tiny_tree())
SAMPLED = SamplingRecord(temperature=0.7, top_p=0.9)
"""The sampling settings `sampled_doc`'s tree records (a version 2 file)."""


def tiny_doc() -> dict[str, Any]:
    doc: dict[str, Any] = msgpack.unpackb(TINY_BYTES)
    return doc


def sampled_doc() -> dict[str, Any]:
    """`tiny_doc` as a version 2 file whose tree records `SAMPLED`."""
    tree = tiny_tree()
    doc: dict[str, Any] = msgpack.unpackb(tree_to_bytes(TrajectoryTree(tree.nodes, tree.records, SAMPLED)))
    return doc


def versioned_tree() -> TrajectoryTree:
    """`tiny_tree` with weight versions on its policy segments: "a" sampled by 4 then 5 (an episode whose
    turns span versions), "b" by 5, "c" by 4 and then an unknown version; the shared node 1 records 4 and 5."""
    versions = {"a": (4, 5), "b": (5,), "c": (4, None)}
    out = []
    for traj in tiny_tree().trajectories():
        it = iter(versions[traj.id])
        segs = tuple(
            replace(s, version=next(it)) if s.role is Role.POLICY else s for s in traj.calls[0].segments
        )
        out.append(replace(traj, calls=(Call(segs),)))
    return build_tree(out)


def versioned_doc() -> dict[str, Any]:
    """`versioned_tree` as a version 2 document."""
    doc: dict[str, Any] = msgpack.unpackb(tree_to_bytes(versioned_tree()))
    return doc


def expect_error(blob: bytes, *fragments: str) -> str:
    with pytest.raises(TreeFormatError) as info:
        trees_from_bytes(blob)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message
    return message


def check_load(blob: bytes) -> None:
    """Either a TreeFormatError, or trees that equal the canonical build of their own trajectories."""
    try:
        trees = trees_from_bytes(blob)
    except TreeFormatError:
        return
    for tree in trees:
        rebuilt = build_tree(tree.trajectories())
        assert rebuilt.nodes == tree.nodes
        assert rebuilt.records == tree.records
        assert rebuilt.id == tree.id
    again = trees_from_bytes(trees_to_bytes(trees))
    assert [(t.id, t.sampling, t.records) for t in again] == [(t.id, t.sampling, t.records) for t in trees]


def first_tree(doc: dict[str, Any]) -> dict[str, Any]:
    """trees[0] of a decoded document."""
    tree: dict[str, Any] = doc["trees"][0]
    return tree
