"""Tree files: round trips, groups, limits, the checked-in files, and atomic writes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support.scripts import load_script
from support.tree_samples import TINY_BYTES, tiny_tree

from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree.build import build_tree
from treetrain.tree.format import (
    Limits,
    TreeFormatError,
    load_tree,
    load_trees,
    save_tree,
    save_trees,
    tree_from_bytes,
    tree_to_bytes,
    trees_from_bytes,
    trees_to_bytes,
)
from treetrain.tree.stats import tree_stats

ASSETS = Path(__file__).parents[1] / "assets"
REPO = Path(__file__).parents[2]


# ----- fixtures on disk -------------------------------------------------------------------------------
def test_tiny_asset_still_loads() -> None:
    """Files written by version 1 keep loading to the same tree."""
    loaded = load_tree(ASSETS / "tree_tiny.msgpack")
    assert loaded.nodes == tiny_tree().nodes
    assert loaded.records == tiny_tree().records


def test_bad_parent_asset() -> None:
    """tests/assets/tree_bad_parent.msgpack is tree_tiny.msgpack with nodes[2].parent set to 7."""
    with pytest.raises(
        TreeFormatError, match=r"nodes\[2\]\.parent: 7 is not a valid parent index \(must be < 2\)"
    ):
        load_tree(ASSETS / "tree_bad_parent.msgpack")


def _load_make_examples() -> Any:
    return load_script("trees/make_examples.py", "make_examples")


def test_checked_in_examples_match_the_script() -> None:
    examples = _load_make_examples().EXAMPLES
    assert {"tool_use.msgpack", "long_prefix.msgpack"} <= set(examples)
    for name, make in examples.items():
        built, stored = make(), load_tree(REPO / "trees" / name)
        assert stored.nodes == built.nodes and stored.records == built.records, name


def test_tool_use_example_has_the_promised_shape() -> None:
    tree = load_tree(REPO / "trees" / "tool_use.msgpack")
    child_roles = {tree.nodes[c].roles[0] for d in tree.divergence_points() for c in tree.nodes[d].children}
    assert {Role.POLICY, Role.OBSERVATION} <= child_roles  # diverges at assistant turns and tool results
    internal = [n for n in tree.nodes[1:] if n.children]
    assert any(Role.POLICY in n.roles for n in internal)
    assert tree_stats(tree).depth >= 3
    assert all(r.step_rewards for r in tree.records)
    assert all(tree.sampler_logprobs(ref) is not None for ref in tree.call_refs())
    long = load_tree(REPO / "trees" / "long_prefix.msgpack")
    assert len(long.nodes[1]) >= 2048 and len(long.nodes[1].children) >= 16


# ----- round trips, groups, limits --------------------------------------------------------------------
def test_group_round_trip_and_single_tree_api(tmp_path: Path) -> None:
    a, b = (
        tiny_tree(),
        build_tree([Trajectory("z", (Call((Segment(Role.PROMPT, (4,)), Segment(Role.POLICY, (5,)))),), 2.0)]),
    )
    save_trees([a, b], tmp_path / "g.msgpack")
    assert [t.id for t in load_trees(tmp_path / "g.msgpack")] == [a.id, b.id]
    with pytest.raises(TreeFormatError, match="group of 2 trees"):
        load_tree(tmp_path / "g.msgpack")
    save_tree(a, tmp_path / "one.msgpack")
    assert load_tree(tmp_path / "one.msgpack").id == a.id
    assert tree_from_bytes(tree_to_bytes(b)).id == b.id
    with pytest.raises(TreeFormatError, match="at least one tree"):
        trees_to_bytes([])


def test_token_that_does_not_fit_uint32_is_refused_on_write() -> None:
    tree = build_tree(
        [Trajectory("t", (Call((Segment(Role.PROMPT, (1,)), Segment(Role.POLICY, (2**32,)))),), 0.0)]
    )
    with pytest.raises(TreeFormatError, match=r"nodes\[1\]\.tokens: token id 4294967296"):
        tree_to_bytes(tree)


def test_file_size_limit_is_checked_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "t.msgpack"
    path.write_bytes(TINY_BYTES)
    small = Limits(max_file_bytes=len(TINY_BYTES) - 1)
    with pytest.raises(TreeFormatError, match="exceeds the limit"):
        load_trees(path, small)
    with pytest.raises(TreeFormatError, match="exceeds the limit"):
        trees_from_bytes(TINY_BYTES, small)
    assert load_trees(path, Limits(max_file_bytes=len(TINY_BYTES)))


def test_total_token_limit() -> None:
    """T is bounded before the calls are rebuilt: shared prefixes make it grow faster than the file."""
    total = tree_stats(tiny_tree()).total_tokens
    with pytest.raises(
        TreeFormatError, match=rf"trees\[0\]\.trajectories\[2\]\.calls\[0\]\.end: .* {total} tokens"
    ):
        trees_from_bytes(TINY_BYTES, Limits(max_total_tokens=total - 1))
    assert trees_from_bytes(TINY_BYTES, Limits(max_total_tokens=total))


# ----- atomic writes ----------------------------------------------------------------------------------
class _HalfWriter:
    """A file object that writes half of what it is given, then fails like a full disk."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def __enter__(self) -> _HalfWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def write(self, data: bytes) -> int:
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failure", ["write", "fsync", "replace"])
def test_failed_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    path = tmp_path / "tree.msgpack"
    save_tree(tiny_tree(), path)
    old = path.read_bytes()
    other = build_tree(
        [
            Trajectory(
                "z", (Call((Segment(Role.PROMPT, (1,)), Segment(Role.POLICY, tuple(range(1000))))),), 2.0
            )
        ]
    )

    def fail(*args: object) -> None:
        raise OSError(5, f"{failure} failed")

    if failure == "write":
        real_fdopen = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda fd, mode: _HalfWriter(real_fdopen(fd, mode)))
    else:
        monkeypatch.setattr(os, failure, fail)
    with pytest.raises(OSError):
        save_tree(other, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["tree.msgpack"]
    assert path.read_bytes() == old
    assert load_tree(path).id == tiny_tree().id
    with pytest.raises(OSError):  # a first write that fails leaves nothing at all
        monkeypatch.setattr(os, "fsync", fail)
        save_tree(other, tmp_path / "new.msgpack")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["tree.msgpack"]
    save_tree(other, path)
    assert load_tree(path).id == other.id
    assert os.listdir(tmp_path) == ["tree.msgpack"]


def test_a_group_holding_one_tree_twice_is_refused_naming_its_trajectories() -> None:
    """Its trajectories would be trained twice (the update manifest refused it only deep in a run)."""
    tree = tiny_tree()
    with pytest.raises(TreeFormatError, match=r"trees\[1\]: the same tree as trees\[0\] .*'a', 'b', 'c'"):
        trees_from_bytes(trees_to_bytes([tree, tree]))
