"""Checks across the tree files of one run or one plan: token ids inside the model's vocabulary, and no
tree given twice.

Both run on loaded trees, before any model is built or sized from them: a token id read from a file is
never used to size an embedding (a hostile id of 2**32 - 1 would ask for hundreds of GiB), and a tree
given twice (the same file named twice, or two copies) would train its trajectories twice. Errors are
`TreeFormatError`s naming the file, the id and the trajectories.

Example:
    >>> from treetrain.trajectory import Call, Role, Segment, Trajectory
    >>> from treetrain.tree.build import build_tree
    >>> call = Call((Segment(Role.PROMPT, (1, 2)), Segment(Role.POLICY, (70,))))
    >>> tree = build_tree([Trajectory("t0", (call,), reward=1.0)])
    >>> largest_token([tree])
    (70, 't0')
    >>> check_vocabulary([("a.msgpack", (tree,))], 64)
    Traceback (most recent call last):
    ...
    treetrain.tree.schema.TreeFormatError: a.msgpack: token id 70 is outside the model's vocabulary of 64 (ids 0..63), in trajectory 't0'; were these trees tokenized with another tokenizer?
"""

from __future__ import annotations

from collections.abc import Sequence

from treetrain.tree.schema import TreeFormatError
from treetrain.tree.trajectory_tree import TrajectoryTree
from treetrain.tree.unpack import short_repr

NamedTrees = Sequence[tuple[str, Sequence[TrajectoryTree]]]
"""(file name, the trees it holds), in the order given."""


def largest_token(trees: Sequence[TrajectoryTree]) -> tuple[int, str]:
    """The largest token id in `trees` and the id of a trajectory holding it ((-1, "") when no tokens)."""
    top, where = -1, ""
    for tree in trees:
        for node in tree.nodes:
            if node.tokens and max(node.tokens) > top:
                top, where = max(node.tokens), tree.records[min(node.trajectories)].id
    return top, where


def check_vocabulary(named: NamedTrees, vocab_size: int) -> None:
    """Refuse the first file holding a token id >= `vocab_size`, naming the file, a trajectory and the id."""
    for name, trees in named:
        top, trajectory = largest_token(trees)
        if top >= vocab_size:
            raise TreeFormatError(
                f"{name}: token id {top} is outside the model's vocabulary of {vocab_size} (ids "
                f"0..{vocab_size - 1}), in trajectory {short_repr(trajectory, 40)}; were these trees tokenized "
                "with another tokenizer?"
            )


def check_distinct(named: NamedTrees) -> None:
    """Refuse a tree that appears in two files (or twice in one), naming both and its trajectories."""
    first: dict[str, str] = {}
    for name, trees in named:
        for tree in trees:
            if tree.id in first:
                ids = ", ".join(short_repr(r.id, 24) for r in tree.records[:3])
                more = f" and {len(tree.records) - 3} more" if len(tree.records) > 3 else ""
                raise TreeFormatError(
                    f"{name}: holds the same tree (id {tree.id}) as {first[tree.id]}, so its trajectories "
                    f"{ids}{more} would be trained twice"
                )
            first[tree.id] = name
