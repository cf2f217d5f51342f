"""The on-disk queue of an asynchronous run (`treetrain.rollout.sources.tree_queue`): a marker is untrusted
input, and a queued rollout is taken on resume only when the resumed trainer may still train it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treetrain.rollout.sources.tree_queue import (
    MAX_MARKER_BYTES,
    queued_marker,
    read_queued,
    take_queued,
    write_queued,
)
from treetrain.runfs import UnsafePathError
from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree import build_tree
from treetrain.tree.format import save_trees


def test_a_hostile_queue_marker_is_refused_never_followed(tmp_path: Path) -> None:
    out_dir = tmp_path / "rollouts" / "update-00000"
    (out_dir / "trees").mkdir(parents=True)
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"trees": []}))
    queued_marker(out_dir, 0).symlink_to(secret)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        read_queued(tmp_path, 0)
    queued_marker(out_dir, 0).unlink()
    for text in ("[1, 2]", '{"trees": 3}', "{", "x" * (MAX_MARKER_BYTES + 2)):
        queued_marker(out_dir, 0).write_text(text)
        with pytest.raises(ValueError):
            read_queued(tmp_path, 0)
    queued_marker(out_dir, 0).write_text(json.dumps({"trees": ["../../../elsewhere.json"]}))
    with pytest.raises(OSError):  # a name is a name in trees/, never a path out of it
        read_queued(tmp_path, 0)


def _queue(run: Path, update: int, version: int) -> Path:
    """Queue one tree for `update` whose policy tokens were sampled by `version`, as the sampler does."""
    out_dir = run / "rollouts" / f"update-{update:05d}"
    (out_dir / "trees").mkdir(parents=True)
    turn = Call((Segment(Role.PROMPT, (1, 2)), Segment(Role.POLICY, (3, 4), (-0.1, -0.2), version)))
    tree = build_tree([Trajectory("a", (turn,), 1.0), Trajectory("b", (turn,), 0.0)])
    path = out_dir / "trees" / "task.msgpack"
    save_trees([tree], path)
    write_queued(out_dir, 0, [path], step_timeouts=2)
    return out_dir


def test_a_queued_rollout_is_taken_only_by_a_trainer_at_or_past_its_versions(tmp_path: Path) -> None:
    """Tokens of version 3 are taken by a trainer resumed at version 3 (its trees and step timeouts as
    queued); a trainer resumed at version 2 (killed between checkpoints: the run had moved on) samples the
    update again, and the marker is gone. A missing or unreadable marker: sampled again."""
    out_dir = _queue(tmp_path, 4, version=3)
    taken = take_queued(tmp_path, out_dir, 4, rank=0, version=3)
    assert taken is not None and taken.step_timeouts == 2 and not taken.failures
    assert [t.id for t in taken.trees] == [t.id for t in read_queued(tmp_path, 4).trees]
    assert take_queued(tmp_path, out_dir, 4, rank=0, version=2) is None
    assert not queued_marker(out_dir, 0).exists()
    assert take_queued(tmp_path, out_dir, 4, rank=0, version=9) is None  # no marker: nothing queued
    queued_marker(out_dir, 0).write_text("{")
    assert take_queued(tmp_path, out_dir, 4, rank=0, version=9) is None
