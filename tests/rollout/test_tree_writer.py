"""The rollout's tree writer (`treetrain.rollout.tree_writer`): trees are written off the calling thread,
every write has finished when `close` returns, and a failed write is raised, not lost."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from treetrain.rollout import tree_writer
from treetrain.rollout.tree_writer import TreeWriter
from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree.format import load_tree


def _trajectory(tid: str, token: int) -> Trajectory:
    return Trajectory(tid, (Call((Segment(Role.PROMPT, (1, 2)), Segment(Role.POLICY, (token,)))),), 1.0)


def test_trees_are_written_on_the_writer_thread_before_close_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    real = tree_writer.save_tree

    def recording(tree: object, path: Path) -> None:
        threads.append(threading.current_thread().name)
        real(tree, path)  # type: ignore[arg-type]

    monkeypatch.setattr(tree_writer, "save_tree", recording)
    writer = TreeWriter(tmp_path)
    writer.put(1, "env-s1", [_trajectory("env-s1/0", 3)])
    writer.put(0, "env-s0", [_trajectory("env-s0/0", 4)])
    saved = writer.close()
    assert sorted(saved) == [0, 1] and all(name.startswith("treetrain-tree-writer") for name in threads)
    assert threading.current_thread().name not in threads
    for tree, path in saved.values():
        assert load_tree(path).id == tree.id


def test_a_failed_write_is_raised_by_close(tmp_path: Path) -> None:
    writer = TreeWriter(tmp_path / "not-there")  # no such directory: the atomic write fails
    writer.put(0, "env-s0", [_trajectory("env-s0/0", 3)])
    with pytest.raises(OSError):
        writer.close()
    ok = TreeWriter(tmp_path)  # control: the same tree into a directory that exists
    ok.put(0, "env-s0", [_trajectory("env-s0/0", 3)])
    assert len(ok.close()) == 1
