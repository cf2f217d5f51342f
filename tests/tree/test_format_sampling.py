"""A tree's sampling settings in the file (format version 2): they round-trip, a group without them is still
written as version 1 (so every file a version-1 reader took is written as before), version-1 files still
load, and a hostile `sampling` map is refused naming the field."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
from support.tree_samples import SAMPLED, TINY_BYTES, expect_error, first_tree, sampled_doc, tiny_tree

from treetrain.trajectory import TrajectoryError
from treetrain.tree import SamplingRecord, TrajectoryTree
from treetrain.tree.build import build_tree
from treetrain.tree.format import load_trees, save_trees, trees_from_bytes, trees_to_bytes
from treetrain.tree.schema import FORMAT_VERSION

ASSETS = Path(__file__).parents[1] / "assets"


def _sampled(tree: TrajectoryTree, sampling: SamplingRecord | None) -> TrajectoryTree:
    return TrajectoryTree(tree.nodes, tree.records, sampling)


def test_sampling_round_trips_through_a_file(tmp_path: Path) -> None:
    tree = build_tree(tiny_tree().trajectories(), SAMPLED)
    assert tree.sampling == SAMPLED
    path = tmp_path / "t.msgpack"
    save_trees([tree], path)
    assert msgpack.unpackb(path.read_bytes())["version"] == FORMAT_VERSION == 2
    (loaded,) = load_trees(path)
    assert loaded.sampling == SamplingRecord(0.7, 0.9)
    assert loaded.id == tree.id == tiny_tree().id  # metadata, not content
    assert loaded.records == tree.records


def test_a_group_without_sampling_is_written_as_version_1_byte_for_byte() -> None:
    """What version 1 could hold is written exactly as before: the bytes of the checked-in version-1 asset,
    written by the code before version 2 existed."""
    assert trees_to_bytes([tiny_tree()]) == TINY_BYTES == (ASSETS / "tree_tiny.msgpack").read_bytes()
    assert msgpack.unpackb(TINY_BYTES)["version"] == 1
    assert trees_from_bytes(TINY_BYTES)[0].sampling is None


def test_each_tree_of_a_group_keeps_its_own_settings() -> None:
    a, b, c = tiny_tree().trajectories()
    one = _sampled(tiny_tree(), SamplingRecord(1.0))
    other = build_tree([replace(a, id="x")], SamplingRecord(0.5, 0.95))
    bare = build_tree([replace(b, id="y"), replace(c, id="z")])
    data = trees_to_bytes([one, other, bare])
    assert msgpack.unpackb(data)["version"] == 2
    assert [t.sampling for t in trees_from_bytes(data)] == [
        SamplingRecord(1.0, 1.0),
        SamplingRecord(0.5, 0.95),
        None,
    ]


def test_greedy_is_recordable_and_bad_settings_are_refused_at_construction() -> None:
    assert SamplingRecord(0.0).temperature == 0.0
    for kwargs, fragment in (
        ({"temperature": -0.1}, "temperature: -0.1 is below 0"),
        ({"temperature": float("nan")}, "temperature: nan is not a finite number"),
        ({"temperature": True}, "temperature: True is not a finite number"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p: 0.0 is not in (0, 1]"),
        ({"temperature": 1.0, "top_p": 1.01}, "top_p: 1.01 is not in (0, 1]"),
    ):
        with pytest.raises(TrajectoryError) as info:
            SamplingRecord(**kwargs)
        assert str(info.value) == fragment


def _set_sampling(value: Any) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        first_tree(doc)["sampling"] = value

    return mutate


CASES = {
    "not a map": (_set_sampling([0.7, 1.0]), "trees[0].sampling: expected a map, got array"),
    "missing top_p": (_set_sampling({"temperature": 0.7}), "trees[0].sampling: missing field 'top_p'"),
    "extra key": (
        _set_sampling({"temperature": 0.7, "top_p": 1.0, "top_k": 5}),
        "trees[0].sampling: unknown field 'top_k'",
    ),
    "temperature as str": (
        _set_sampling({"temperature": "0.7", "top_p": 1.0}),
        "trees[0].sampling.temperature: expected a number, got str",
    ),
    "temperature nan": (
        _set_sampling({"temperature": float("nan"), "top_p": 1.0}),
        "trees[0].sampling.temperature: nan is not finite",
    ),
    "temperature below 0": (
        _set_sampling({"temperature": -1.0, "top_p": 1.0}),
        "trees[0].sampling.temperature: -1.0 is below 0",
    ),
    "top_p 0": (
        _set_sampling({"temperature": 1, "top_p": 0}),
        "trees[0].sampling.top_p: 0.0 is not in (0, 1]",
    ),
    "top_p inf": (
        _set_sampling({"temperature": 1, "top_p": float("inf")}),
        "trees[0].sampling.top_p: inf is not finite",
    ),
    "in a version 1 file": (
        lambda d: d.update(version=1),
        "trees[0].sampling: a version 1 file has no such field (version 2 added it)",
    ),
}


def test_the_unmutated_sampled_document_loads() -> None:
    """Negative control: each case's error comes from its mutation."""
    (tree,) = trees_from_bytes(msgpack.packb(sampled_doc()))
    assert tree.sampling == SAMPLED


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_sampling(name: str) -> None:
    mutate, fragment = CASES[name]
    doc = sampled_doc()
    mutate(doc)
    message = expect_error(msgpack.packb(doc), fragment)
    assert "\n" not in message
