"""One writer thread for a rollout's trees: building and saving (msgpack, fsync) run beside generation.

The scheduler's thread drives the engine; a tree file's encoding and its `fsync` would stall every batch
behind it. `TreeWriter.put` hands a finished task's trajectories to a single writer thread, which builds
the tree and writes it atomically; `close` waits for every write and raises the first error (a full disk,
a refused path), so a rollout never returns with a tree still only in memory, and never hides a failed
write.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from treetrain.trajectory import Call, Role, Segment, Trajectory
    >>> traj = Trajectory("t/0", (Call((Segment(Role.PROMPT, (1, 2)), Segment(Role.POLICY, (3,)))),), 1.0)
    >>> writer = TreeWriter(Path(tempfile.mkdtemp()))
    >>> writer.put(0, "t", [traj])
    >>> [(i, len(tree.trajectories()), path.suffix) for i, (tree, path) in sorted(writer.close().items())]
    [(0, 1, '.msgpack')]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from treetrain.trajectory import Trajectory
from treetrain.tree import SamplingRecord, TrajectoryTree
from treetrain.tree.build import build_tree
from treetrain.tree.format import save_tree


def portable_name(text: str) -> str:
    """`text` with every character outside `[A-Za-z0-9._-]` replaced by `_`, so a file name made from an
    environment name (`my_pkg.envs:Maze`) is valid on every filesystem.

        >>> portable_name("my_pkg.envs:Maze-s3")
        'my_pkg.envs_Maze-s3'
    """
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


class TreeWriter:
    """Builds and writes trees under `trees_dir` on one thread, in the order they were put; each records
    `sampling`, the settings its tokens were drawn with (the trainer scores at that temperature)."""

    def __init__(self, trees_dir: Path, sampling: SamplingRecord | None = None) -> None:
        self.trees_dir = trees_dir
        self.sampling = sampling
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="treetrain-tree-writer")
        self._writes: dict[int, Future[tuple[TrajectoryTree, Path]]] = {}

    def put(self, index: int, prefix: str, trajectories: Sequence[Trajectory]) -> None:
        """Write task `index`'s tree (named from `prefix`) on the writer thread."""
        self._writes[index] = self._pool.submit(self._write, prefix, tuple(trajectories))

    def _write(self, prefix: str, trajectories: tuple[Trajectory, ...]) -> tuple[TrajectoryTree, Path]:
        tree = build_tree(list(trajectories), self.sampling)
        path = self.trees_dir / f"{portable_name(prefix)}-{tree.id[:12]}.msgpack"
        save_tree(tree, path)
        return tree, path

    def close(self) -> dict[int, tuple[TrajectoryTree, Path]]:
        """Wait for every write; each task's (tree, path) by index, or the first write's error raised."""
        self._pool.shutdown(wait=True)
        return {i: f.result() for i, f in sorted(self._writes.items())}
