"""The on-disk queue of an asynchronous run: finished rollouts waiting for their update, across kill -9.

A finished rollout is queued on disk: its trees are in `rollouts/update-XXXXX/trees/` and
`queued-rank<r>.json` there lists them, written atomically after the last tree, so a marker never names a
tree that is not whole. A resumed run takes a queued update's trees from disk (`take_queued`) if its rollout
had no failed task and no token from weights newer than the resumed trainer's (a run killed between
checkpoints had moved on); any other update is sampled again from its task seeds. A checkpoint says which
updates were trained, so none is trained twice and none is lost. Markers are untrusted on reading: bounded
in size, never read through a link, and naming only files of their own `trees/` folder.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from treetrain.io import atomic_write_text
from treetrain.rollout.engines.generation import EngineStats
from treetrain.rollout.tree_rollout import RolloutResult
from treetrain.runfs import UnsafePathError, read_bytes, remove_file
from treetrain.tree import TrajectoryTree
from treetrain.tree.format import load_trees

log = logging.getLogger(__name__)

MAX_MARKER_BYTES = 1 << 20
"""Largest marker read back (a name per tree of one rank's update: far below this)."""


def queued_marker(out_dir: Path, rank: int) -> Path:
    """The marker of rank `rank`'s finished rollout waiting for its update: the names of its tree files."""
    return out_dir / f"queued-rank{rank}.json"


@dataclass(frozen=True)
class Queued:
    """A finished rollout as its marker lists it: the tree files, their trees, the steps that timed out."""

    paths: tuple[Path, ...]
    trees: tuple[TrajectoryTree, ...]
    step_timeouts: int


def write_queued(out_dir: Path, rank: int, paths: Sequence[Path], step_timeouts: int) -> None:
    """Queue rank `rank`'s finished rollout in `out_dir`: its marker, written atomically after its trees."""
    listed = json.dumps({"trees": [p.name for p in paths], "step_timeouts": step_timeouts})
    atomic_write_text(queued_marker(out_dir, rank), listed)


def read_queued(run_dir: str | Path, update: int, rank: int = 0) -> Queued:
    """Rank `rank`'s queued rollout of `update` in `run_dir` (an `OSError` or `ValueError` when missing or
    unreadable): the trees a resumed run takes, and what tests and benchmarks check token by token."""
    out_dir = Path(run_dir) / "rollouts" / f"update-{update:05d}"
    raw = read_bytes(run_dir, queued_marker(out_dir, rank), MAX_MARKER_BYTES)  # never through a link
    if len(raw) > MAX_MARKER_BYTES:
        raise ValueError(f"{queued_marker(out_dir, rank)}: over {MAX_MARKER_BYTES} bytes")
    listed = json.loads(raw)
    if not isinstance(listed, dict) or not isinstance(listed.get("trees"), list):
        raise ValueError(f"{queued_marker(out_dir, rank)}: not a list of tree files")
    paths = tuple(out_dir / "trees" / Path(str(name)).name for name in listed["trees"])
    return Queued(paths, tuple(t for p in paths for t in load_trees(p)), int(listed.get("step_timeouts", 0)))


def take_queued(
    run_dir: str | Path, out_dir: Path, update: int, rank: int, version: int
) -> RolloutResult | None:
    """The rollout a killed run left queued for `update` in `out_dir`, when a trainer at `version` may still
    train it (see the module docstring); None to sample the update again."""
    marker = queued_marker(out_dir, rank)
    if not os.path.lexists(marker):
        return None
    try:
        queued = read_queued(run_dir, update, rank)
    except (OSError, ValueError, UnsafePathError) as exc:
        log.warning("update %d: the queued rollout cannot be read (%s); sampling it again", update, exc)
        return None
    trees = queued.trees
    newest = max((v for t in trees for vs in t.node_versions for v in vs), default=0)
    if newest > version:
        log.warning(
            "update %d: the queued rollout holds tokens of version %d, newer than the resumed trainer's "
            "%d; sampling it again", update, newest, version,
        )  # fmt: skip
        remove_file(run_dir, marker)
        return None
    log.info("update %d: taking its %d queued trees from %s", update, len(trees), marker.parent)
    return RolloutResult(trees, queued.paths, EngineStats(), (), queued.step_timeouts)
