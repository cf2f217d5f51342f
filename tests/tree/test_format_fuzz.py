"""Fuzzing the tree file reader: mutated, random and structurally perturbed inputs only ever raise
TreeFormatError, and whatever loads is the canonical tree of its own trajectories."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tree_samples import TINY_BYTES, check_load, sampled_doc, tiny_doc, versioned_doc
from support.tree_strategies import trajectory_sets

from treetrain.tree.build import build_tree
from treetrain.tree.format import tree_to_bytes

FUZZ = settings(max_examples=200, deadline=None)


# ----- fuzzing ----------------------------------------------------------------------------------------
@FUZZ
@given(st.data())
def test_byte_mutations_of_valid_files(data: st.DataObject) -> None:
    if data.draw(st.booleans()):
        blob = bytearray(TINY_BYTES)
    else:
        blob = bytearray(tree_to_bytes(build_tree(data.draw(trajectory_sets(max_trajectories=3)))))
    ops = st.tuples(
        st.sampled_from(["flip", "set", "truncate", "insert", "delete"]), st.integers(0), st.integers(0, 255)
    )
    for op, at, byte in data.draw(st.lists(ops, min_size=1, max_size=4)):
        at %= max(1, len(blob))
        if op == "flip" and blob:
            blob[at] ^= 1 << (byte % 8)
        elif op == "set" and blob:
            blob[at] = byte
        elif op == "truncate":
            del blob[at:]
        elif op == "insert":
            blob.insert(at, byte)
        elif op == "delete" and blob:
            del blob[at]
    check_load(bytes(blob))


SCHEMA_KEYS = [
    "format",
    "version",
    "trees",
    "id",
    "nodes",
    "trajectories",
    "parent",
    "tokens",
    "roles",
    "reward",
]
SCHEMA_KEYS += [
    "step_rewards",
    "meta",
    "calls",
    "env",
    "seed",
    "model_version",
    "extra",
    "end",
    "segment_lengths",
]
SCHEMA_KEYS += ["logprobs", "sampling", "temperature", "top_p", "versions"]
KEYS = st.sampled_from(SCHEMA_KEYS) | st.text(max_size=6)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.integers(-2, 8)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=17)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=25,
)


@FUZZ
@given(VALUES, st.binary(max_size=64))
def test_random_msgpack_objects_and_bytes(obj: object, raw: bytes) -> None:
    check_load(msgpack.packb(obj))
    check_load(msgpack.packb({"format": "treetrain.tree", "version": 1, "trees": obj}))
    check_load(msgpack.packb({"format": "treetrain.tree", "version": 2, "trees": obj}))
    check_load(raw)


def _slots(obj: object) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) in a decoded document."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield obj, k
            yield from _slots(v)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield obj, i
            yield from _slots(v)


@FUZZ
@given(st.data())
def test_structured_mutations(data: st.DataObject) -> None:
    doc = data.draw(st.sampled_from([sampled_doc, versioned_doc, tiny_doc]))()
    for _ in range(data.draw(st.integers(1, 3))):
        slots = list(_slots(doc))
        container, key = data.draw(st.sampled_from(slots))
        action = data.draw(st.sampled_from(["replace", "swap", "delete", "add"]))
        if action == "replace":
            container[key] = data.draw(VALUES)
        elif action == "swap":
            other, other_key = data.draw(st.sampled_from(slots))
            container[key] = copy.deepcopy(other[other_key])
        elif action == "delete":
            del container[key]
        elif isinstance(container, dict):
            container[data.draw(KEYS)] = data.draw(VALUES)
        else:
            container.append(data.draw(VALUES))
    check_load(msgpack.packb(doc))
