"""Replay units: tree nodes split into chunks of at most `chunk_size` tokens.

A long node becomes a chain of units, and every rule of the tree algorithm applies to the chain unchanged:
that is checkpointing at chunk granularity, with KV as the checkpoint. Unit 0 is the empty root.

Every unit below the first level carries an *overlap*: its parent unit's last token, fed in front of its
own tokens when it runs under autograd, so the unit's forward predicts all of its own tokens (see
`treetrain.loss.targets`). The overlap's KV is recomputed there; the parent's resident copy of that one
position is left out of the past.

Example:
    >>> units = UnitTree.build(tree, node_targets, chunk_size=512)     # doctest: +SKIP
    >>> [(u.node, u.start, u.end) for u in units.units[1:3]]            # doctest: +SKIP
    [(1, 0, 512), (1, 512, 1024)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from treetrain.loss.targets import TargetTable
from treetrain.tree.trajectory_tree import ROOT, TrajectoryTree


@dataclass(frozen=True)
class Unit:
    """Tokens [start, end) of one node; `offset` is the absolute position of its first token.

    `overlap` is the parent unit's last token (None under the root); `targets` are positions of the
    input `overlap + tokens`.
    """

    index: int
    node: int
    start: int
    end: int
    offset: int
    parent: int | None
    children: tuple[int, ...]
    tokens: tuple[int, ...]
    overlap: int | None
    targets: TargetTable

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def input_tokens(self) -> tuple[int, ...]:
        return self.tokens if self.overlap is None else (self.overlap, *self.tokens)

    @property
    def input_offset(self) -> int:
        return self.offset if self.overlap is None else self.offset - 1

    @property
    def is_leaf(self) -> bool:
        return not self.children


class UnitTree:
    """The tree of units over one `TrajectoryTree`."""

    def __init__(self, tree: TrajectoryTree, units: Sequence[Unit]) -> None:
        self.tree = tree
        self.units = tuple(units)
        self._path: dict[int, tuple[int, ...]] = {}

    @staticmethod
    def build(
        tree: TrajectoryTree, node_targets: Sequence[TargetTable], chunk_size: int | None = None
    ) -> UnitTree:
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
        drafts: list[list] = []  # [node, start, end, offset, parent, children]
        last_unit_of: dict[int, int] = {}
        for node in tree.nodes:  # pre-order: parents come first
            if node.index == ROOT:
                drafts.append([ROOT, 0, 0, 0, None, []])
                last_unit_of[ROOT] = 0
                continue
            assert node.parent is not None
            parent_unit = last_unit_of[node.parent]
            step = chunk_size or len(node)
            for start in range(0, len(node), step):
                end = min(len(node), start + step)
                idx = len(drafts)
                drafts.append([node.index, start, end, node.offset + start, parent_unit, []])
                drafts[parent_unit][5].append(idx)
                parent_unit = idx
            last_unit_of[node.index] = parent_unit
        units: list[Unit] = []
        for i, (n, s, e, off, par, kids) in enumerate(drafts):
            node = tree.nodes[n]
            overlap = None if par in (None, ROOT) else units[par].tokens[-1]
            targets = node_targets[n].for_unit(s, e, overlap is not None) if n != ROOT else node_targets[ROOT]
            units.append(Unit(i, n, s, e, off, par, tuple(kids), node.tokens[s:e], overlap, targets))
        return UnitTree(tree, units)

    def __len__(self) -> int:
        return len(self.units)

    def __getitem__(self, index: int) -> Unit:
        return self.units[index]

    def path(self, index: int) -> tuple[int, ...]:
        """Units from the first real unit down to `index` inclusive (the empty root excluded)."""
        cached = self._path.get(index)
        if cached is not None:
            return cached
        out: list[int] = []
        cur: int | None = index
        while cur is not None and cur != ROOT:
            out.append(cur)
            cur = self.units[cur].parent
        result = tuple(reversed(out))
        self._path[index] = result
        return result
