"""Find and load trees for inspection: one tree file, a directory of them, or a run directory.

A run directory keeps its trees under `rollouts/update-XXXXX/trees/` (the trainer) or `trees/` (a bare
`rollout_trees` call); both are found by searching the directory recursively for `*.msgpack`. Files are
read with the format's size limits, so a hostile file is refused with `TreeFormatError`.

Example:
    >>> trees = load_tree_sources("trees")                                  # doctest: +SKIP
    >>> [(t.name, tree_stats(t.tree).num_trajectories) for t in trees]      # doctest: +SKIP
    [('context_rewrite', 4), ('long_prefix', 16), ('tool_use', 11)]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from treetrain.io import path_problem
from treetrain.tree.format import load_trees
from treetrain.tree.trajectory_tree import TrajectoryTree


@dataclass(frozen=True)
class NamedTree:
    """A loaded tree and where it came from."""

    name: str
    """Readable name: the file's path relative to the searched directory, without `.msgpack`; a file
    holding a group of several trees adds `#i`."""
    path: Path
    """The file it was read from."""
    index: int
    """Position of the tree in its file's group."""
    tree: TrajectoryTree


def tree_files(path: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The tree file itself, or every `*.msgpack` under a directory (recursively, sorted)."""
    p = Path(path)
    if p.is_file():
        return (p,)
    if p.is_dir():
        return tuple(sorted(p.rglob("*.msgpack")))
    raise FileNotFoundError(path_problem(p, "file") or f"no tree file or directory at {str(p)!r}")


def load_tree_sources(path: str | os.PathLike[str]) -> tuple[NamedTree, ...]:
    """Every tree in a file, a directory or a run directory; raises FileNotFoundError if there are none."""
    root = Path(path)
    files = tree_files(root)
    if not files:
        raise FileNotFoundError(f"no *.msgpack tree files under {str(root)!r}")
    out: list[NamedTree] = []
    for f in files:
        stem = f.name.removesuffix(".msgpack") if root.is_file() else str(f.relative_to(root))
        stem = stem.removesuffix(".msgpack")
        group = load_trees(f)
        for i, tree in enumerate(group):
            name = stem if len(group) == 1 else f"{stem}#{i}"
            out.append(NamedTree(name, f, i, tree))
    return tuple(out)


def tree_groups(path: str | os.PathLike[str]) -> tuple[tuple[str, tuple[TrajectoryTree, ...]], ...]:
    """(file name, its group of trees) for every tree file in a file or directory, as planning takes them
    (a file's trees are one advantage group); raises FileNotFoundError if there are none."""
    files = tree_files(path)
    if not files:
        raise FileNotFoundError(f"no *.msgpack tree files under {os.fspath(path)!r}")
    return tuple((str(f), load_trees(f)) for f in files)


TREES_VARIABLE = "TREETRAIN_TREES"
"""The environment variable a notebook reads for the trees to show (a tree file, a directory, a run)."""
SHIPPED_TREES = Path(__file__).resolve().parents[2] / "trees"
"""The checked-in example trees, beside the package in a source checkout."""


def notebook_trees(environ: dict[str, str] | None = None) -> Path:
    """What a notebook shows: `$TREETRAIN_TREES` (a tree file, a directory of them or a run directory)
    when it is set, else the shipped examples. Raises `FileNotFoundError` saying both where it looked and
    how to point it elsewhere, never a bare `StopIteration` (a notebook copied out of the repository).

    A relative path is the one the user typed in the shell that started Jupyter
    (`TREETRAIN_TREES=runs/demo jupyter lab` from the repository's root), while the kernel runs in the
    notebook's own folder: when it names nothing from there, it is read from `$PWD`, the shell's directory,
    which the server and its kernels inherit.

    Example:
        >>> notebook_trees({"TREETRAIN_TREES": "runs/demo"})
        PosixPath('runs/demo')
        >>> notebook_trees({}) == SHIPPED_TREES
        True
    """
    env = os.environ if environ is None else environ
    if env.get(TREES_VARIABLE):
        named = Path(env[TREES_VARIABLE]).expanduser()
        started_in = env.get("PWD")
        if named.is_absolute() or os.path.lexists(named) or not started_in:
            return named
        from_shell = Path(started_in) / named
        return from_shell if os.path.lexists(from_shell) else named
    if SHIPPED_TREES.is_dir():
        return SHIPPED_TREES
    raise FileNotFoundError(
        f"no trees to show: ${TREES_VARIABLE} is not set, and the shipped examples are not at {SHIPPED_TREES} "
        f"(treetrain is installed without its repository); set {TREES_VARIABLE} to a tree file, a directory "
        "of them or a run directory"
    )
