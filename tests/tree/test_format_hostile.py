"""Hostile tree files: each malformed field gets a TreeFormatError naming it, and a declared length
never makes the reader allocate more than the input."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from support.tree_samples import TINY_BYTES, expect_error, first_tree, tiny_doc, tiny_tree

from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree.build import build_tree
from treetrain.tree.format import TreeFormatError, tree_to_bytes, trees_from_bytes


# ----- documents ------------------------------------------------------------------------------
def _drop_ids(doc: dict[str, Any]) -> None:
    first_tree(doc).pop("id")
    for node in first_tree(doc)["nodes"]:
        node.pop("id")


def _reorder(doc: dict[str, Any], order: list[int]) -> None:
    """Store the nodes in `order` (old indices), remapping parents and call ends."""
    _drop_ids(doc)
    nodes = first_tree(doc)["nodes"]
    new_of = {old: new for new, old in enumerate(order)}
    for node in nodes:
        node["parent"] = None if node["parent"] is None else new_of[node["parent"]]
    first_tree(doc)["nodes"] = [nodes[old] for old in order]
    for traj in first_tree(doc)["trajectories"]:
        for call in traj["calls"]:
            call["end"] = new_of[call["end"]]


def _split_node_1(doc: dict[str, Any]) -> None:
    """Store node 1 as two nodes, so the first is not a maximal run."""
    _drop_ids(doc)
    nodes = first_tree(doc)["nodes"]
    first = {"parent": 0, "tokens": nodes[1]["tokens"][:8], "roles": nodes[1]["roles"][:2]}
    nodes[1] = {"parent": 1, "tokens": nodes[1]["tokens"][8:], "roles": nodes[1]["roles"][2:]}
    for node in nodes[2:]:
        node["parent"] += 1
    nodes.insert(1, first)
    for traj in first_tree(doc)["trajectories"]:
        for call in traj["calls"]:
            call["end"] += 1


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """A mutator setting a dotted path inside trees[0] (integers index arrays)."""

    def mutate(doc: dict[str, Any]) -> None:
        target: Any = first_tree(doc)
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value

    return mutate


def _all(*mutators: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        for m in mutators:
            m(doc)

    return mutate


def _no_policy_tokens(doc: dict[str, Any]) -> None:
    tree = build_tree(
        [Trajectory("x", (Call((Segment(Role.PROMPT, (1,)), Segment(Role.POLICY, (1, 2)))),), 0.0)]
    )
    doc["trees"] = [msgpack.unpackb(tree_to_bytes(tree))["trees"][0]]
    _drop_ids(doc)
    first_tree(doc)["nodes"][1]["roles"] = b"\x00\x00\x00"
    first_tree(doc)["trajectories"][0]["calls"][0]["logprobs"] = []


F64 = np.float64
CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "parent out of range": (
        _set("nodes.2.parent", 7),
        "trees[0].nodes[2].parent: 7 is not a valid parent index",
    ),
    "parent cycle": (
        _all(_set("nodes.1.parent", 2), _set("nodes.2.parent", 1)),
        "nodes[1].parent: 2 is not a valid parent index (must be < 1)",
    ),
    "self parent": (
        _set("nodes.3.parent", 3),
        "nodes[3].parent: 3 is not a valid parent index (must be < 3)",
    ),
    "negative parent": (_set("nodes.3.parent", -1), "nodes[3].parent: -1 is not a valid parent index"),
    "two roots": (_set("nodes.5.parent", None), "nodes[5].parent: nil, but only node 0 may be a root"),
    "root with a parent": (
        _set("nodes.0.parent", 0),
        "nodes[0].parent: the root (node 0) must have parent nil",
    ),
    "root with tokens": (
        _all(_set("nodes.0.tokens", b"\0" * 4), _set("nodes.0.roles", b"\0")),
        "nodes[0].tokens: the root",
    ),
    "empty node": (_all(_set("nodes.5.tokens", b""), _set("nodes.5.roles", b"")), "nodes[5].tokens: empty"),
    "parent of wrong type": (_set("nodes.2.parent", "1"), "nodes[2].parent: expected an int, got str"),
    "parent is a bool": (_set("nodes.2.parent", True), "nodes[2].parent: expected an int, got bool"),
    "tokens as array": (_set("nodes.1.tokens", [11, 12, 13, 21]), "nodes[1].tokens: expected bin"),
    "ragged token bytes": (
        _set("nodes.5.tokens", b"\0" * 5),
        "nodes[5].tokens: 5 bytes is not a whole number",
    ),
    "roles length": (_set("nodes.1.roles", b"\0\0\0"), "nodes[1].roles: 3 role codes for 4 tokens"),
    "unknown role code": (_set("nodes.1.roles", b"\0\0\7\1"), "nodes[1].roles[2]: unknown role code 7"),
    "node id mismatch": (_set("nodes.1.id", "0" * 32), "nodes[1].id: stored"),
    "tree id mismatch": (_set("id", "f" * 32), "trees[0].id: stored"),
    "tree id of wrong type": (_set("id", 5), "trees[0].id: expected a str, got int"),
    "nan reward": (_set("trajectories.0.reward", math.nan), "trajectories[0].reward: nan is not finite"),
    "inf reward": (_set("trajectories.1.reward", -math.inf), "trajectories[1].reward: -inf is not finite"),
    "reward too large to normalize": (
        _set("trajectories.0.reward", 1e308),
        "trajectories[0].reward: 1e+308 is outside +-1e+15",
    ),
    "reward as str": (
        _set("trajectories.0.reward", "1"),
        "trajectories[0].reward: expected a number, got str",
    ),
    "logprobs on a non-policy segment": (
        _all(_drop_ids, _set("nodes.3.roles", b"\2\2")),
        "trajectories[0].calls[0].logprobs: 2 entries but the call has 1 policy segments",
    ),
    "logprobs too short": (
        _set("trajectories.0.calls.0.logprobs.0", F64(-1.0).tobytes()),
        "trajectories[0].calls[0].logprobs[0]: 8 bytes, but the policy segment has 2 tokens",
    ),
    "positive logprob": (
        _set("trajectories.0.calls.0.logprobs.1", F64(0.5).tobytes()),
        "logprobs[1][0]: 0.5 is not a finite log-probability <= 0",
    ),
    "nan logprob": (
        _set("trajectories.0.calls.0.logprobs.1", F64(math.nan).tobytes()),
        "logprobs[1][0]: nan",
    ),
    "segment sum": (
        _set("trajectories.0.calls.0.segment_lengths", [3, 2, 1]),
        "calls[0].segment_lengths: they sum to 6 but the path to nodes[3] has 7 tokens",
    ),
    "segment mixes roles": (
        _set("trajectories.0.calls.0.segment_lengths", [4, 1, 1, 1]),
        "segment_lengths[0]: the segment at positions 0..3 mixes roles (prompt at 0, policy at 3)",
    ),
    "zero-length segment": (
        _set("trajectories.1.calls.0.segment_lengths", [0, 5]),
        "segment_lengths[0]: 0 is out",
    ),
    "step reward count": (
        _set("trajectories.0.step_rewards", [1.0]),
        "trajectories[0].step_rewards: 1 entries but the trajectory has 2 policy segments",
    ),
    "inf step reward": (
        _set("trajectories.0.step_rewards", [1.0, math.inf]),
        "step_rewards[1]: inf is not finite",
    ),
    "duplicate trajectory id": (
        _set("trajectories.1.id", "a"),
        "trajectories[1].id: 'a' duplicates trajectories[0]",
    ),
    "empty trajectory id": (_set("trajectories.1.id", ""), "trajectories[1].id: empty"),
    "call ends at the root": (
        _set("trajectories.1.calls.0.end", 0),
        "calls[0].end: 0 is not a node index in [1, 5]",
    ),
    "call ends past the nodes": (
        _set("trajectories.1.calls.0.end", 9),
        "calls[0].end: 9 is not a node index",
    ),
    "no calls": (_set("trajectories.1.calls", []), "trajectories[1].calls: needs at least 1"),
    "siblings out of order": (
        lambda d: _reorder(d, [0, 1, 2, 4, 3, 5]),
        "nodes[4]: starts with (token, role code) (31, 2), which does not sort after",
    ),
    "not pre-order": (lambda d: _reorder(d, [0, 1, 2, 5, 3, 4]), "nodes[4]: not in depth-first pre-order"),
    "not a maximal run": (_split_node_1, "nodes[1]: one child (nodes[2]) and no call ending here"),
    "leaf without a call": (
        _all(
            _drop_ids,
            lambda d: first_tree(d)["nodes"].append({"parent": 1, "tokens": b"c\0\0\0", "roles": b"\2"}),
        ),
        "nodes[6]: a leaf at which no call ends",
    ),
    "no policy tokens": (_no_policy_tokens, "trees[0].trajectories[0]: trajectory 'x' has no policy tokens"),
    "unknown field": (_set("colour", "red"), "trees[0]: unknown field 'colour'"),
    "missing field": (
        lambda d: first_tree(d)["trajectories"][0].pop("meta"),
        "trajectories[0]: missing field 'meta'",
    ),
    "float seed": (
        _set("trajectories.0.meta.seed", 1.5),
        "trajectories[0].meta.seed: expected an int, got float",
    ),
    "extra value not str": (
        _set("trajectories.0.meta.extra", {"k": 1}),
        "meta.extra['k']: expected a str, got int",
    ),
    "no nodes": (_set("nodes", []), "trees[0].nodes: needs at least 1"),
    "no trajectories": (_set("trajectories", []), "trees[0].trajectories: needs at least 1"),
    "wrong version": (
        lambda d: d.update(version=3),
        "file.version: 3 is not supported (this reader knows 1, 2)",
    ),
    "version as str": (lambda d: d.update(version="1"), "file.version: expected an int, got str"),
    "unknown format": (
        lambda d: d.update(format="other.tree"),
        "file.format: 'other.tree' is not 'treetrain.tree'",
    ),
    "no trees": (lambda d: d.update(trees=[]), "trees: needs at least 1"),
    "extra top-level field": (lambda d: d.update(comment="hi"), "file: unknown field 'comment'"),
}


def test_case_table_mutations_are_isolated() -> None:
    """Negative control: the unmutated document loads, so each case's error comes from its mutation."""
    assert trees_from_bytes(msgpack.packb(tiny_doc()))[0].id == tiny_tree().id


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_document(name: str) -> None:
    mutate, fragment = CASES[name]
    doc = tiny_doc()
    mutate(doc)
    expect_error(msgpack.packb(doc), fragment)


RAW_CASES: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "file: empty"),
    "top-level array": (msgpack.packb([1, 2]), "not a treetrain tree file"),
    "top-level int, then more": (b"\x23 treetrain", "not a treetrain tree file (it looks like text"),
    "map of another format, then more": (
        msgpack.packb({"format": "x"}) + b"\xc0",
        "not a treetrain tree file",
    ),
    "trailing data": (TINY_BYTES + b"\xc0", "1 bytes of trailing data"),
    "truncated": (TINY_BYTES[:-3], "ends early"),
    "duplicate key": (
        b"\x82" + (msgpack.packb("format") + msgpack.packb(1)) * 2,
        "duplicate map key 'format'",
    ),
    "ext type": (msgpack.packb({"format": msgpack.ExtType(5, b"x")}), "ext"),
    "empty ext type": (b"\x81\xa6format\xc7\x00\x05", "ext type 5 is not allowed"),
    "timestamp": (msgpack.packb({"format": msgpack.Timestamp(1, 0)}), "ext"),
    "deep nesting": (b"\x91" * 100_000 + b"\xc0", "file:"),
    "invalid utf-8": (b"\x81\xa6format\xa2\xff\xfe", "not a valid msgpack document"),
    "int map key": (b"\x81\x01\x02", "not a valid msgpack document"),
    "4 GiB bin": (b"\x81\xa6format\xc6\xff\xff\xff\xff", "ends early"),
    "4 Gi array": (b"\x81\xa6format\xdd\xff\xff\xff\xff", "file:"),
    "4 Gi map": (b"\xdf\xff\xff\xff\xff", "file:"),
    "4 GiB str": (b"\x81\xa6format\xdb\xff\xff\xff\xff", "file:"),
}


@pytest.mark.parametrize("name", list(RAW_CASES))
def test_hostile_bytes(name: str) -> None:
    blob, fragment = RAW_CASES[name]
    expect_error(blob, fragment)


# ----- allocation ---------------------------------------------------------------------------------------
def peak_allocation(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _splice(doc: dict[str, Any], header: bytes) -> bytes:
    """Pack `doc` with nodes[1].tokens replaced by a bare length header (no payload behind it)."""
    marker = b"\xee" * 12
    first_tree(doc)["nodes"][1]["tokens"] = marker
    blob = msgpack.packb(doc)
    return blob.replace(b"\xc4\x0c" + marker, header)


@pytest.mark.parametrize(
    "header",
    [b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"],
    ids=["bin32", "array32", "map32", "str32"],
)
def test_declared_4_gib_does_not_allocate(header: bytes) -> None:
    blob = _splice(tiny_doc(), header)
    assert header in blob

    def load() -> None:
        with pytest.raises(TreeFormatError):
            trees_from_bytes(blob)

    assert peak_allocation(load) < 1 << 20


def test_allocation_measurement_sees_real_allocations() -> None:
    """Negative control for the check above."""
    assert peak_allocation(lambda: bytearray(8 << 20)) > 8 << 20
