"""Placement: which rank replays which trajectories of each tree.

A rank that owns some trajectories of a tree must run every node on their paths: the shared ancestors are
recomputed on each rank that owns a descendant (resident KV never crosses ranks). So a placement trades
balance (the busiest rank sets the step time) against duplicated ancestor work. The cost of a rank is its
replay tokens: the tokens of the union of nodes its trajectories pass through, per tree.

`place` cuts trees into subtrees only as far as balance needs: it starts from whole trees, splits the most
expensive piece at its first divergence point, assigns pieces largest-first to the rank whose load grows
least (a piece next to its siblings costs only its own suffix there), and keeps the best assignment over all
split depths by (busiest rank, duplicated tokens). It is deterministic, so every rank computes the same
placement from the same trees; the update window still agrees on its digest.

Example:
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> trees = [synthetic_group(prefix=8, branches=2, suffix=4, depth=1, vocab=50, seed=s) for s in range(2)]
    >>> p = place(trees, world_size=2)
    >>> p.duplicated_tokens, sorted(len(p.owned[t][r]) for t in range(2) for r in range(2))
    (0, [0, 0, 2, 2])
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

from treetrain.tree.trajectory_tree import ROOT, TrajectoryTree


@dataclass(frozen=True)
class Placement:
    """Trajectory indices per tree and rank, with the replay cost they imply."""

    world_size: int
    tree_ids: tuple[str, ...]
    owned: tuple[tuple[frozenset[int], ...], ...]
    """owned[tree][rank]: the trajectory indices of that tree the rank replays."""
    rank_tokens: tuple[int, ...]
    """Replay tokens per rank (union of the nodes its trajectories pass through, summed over trees)."""
    unique_tokens: int
    """Tokens of every tree counted once: the cost of one process doing everything."""

    @property
    def duplicated_tokens(self) -> int:
        """Ancestor tokens recomputed on more than one rank."""
        return sum(self.rank_tokens) - self.unique_tokens

    @property
    def makespan(self) -> int:
        """Replay tokens of the busiest rank."""
        return max(self.rank_tokens, default=0)

    def for_rank(self, rank: int) -> tuple[frozenset[int], ...]:
        """The `owned` argument of `UpdateBatch.build` for this rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return tuple(per_rank[rank] for per_rank in self.owned)

    @cached_property
    def digest(self) -> str:
        h = hashlib.sha256(f"w{self.world_size}".encode())
        for tree_id, per_rank in zip(self.tree_ids, self.owned):
            h.update(f"|{tree_id}".encode())
            for rank, trajs in enumerate(per_rank):
                h.update(f";{rank}:{','.join(map(str, sorted(trajs)))}".encode())
        return h.hexdigest()

    def restricted_to(self, trees: Sequence[TrajectoryTree]) -> Placement:
        """The same assignment for a subset of the trees (e.g. after a group was dropped)."""
        index = {tid: i for i, tid in enumerate(self.tree_ids)}
        missing = [t.id[:12] for t in trees if t.id not in index]
        if missing:
            raise ValueError(f"placement has no entry for trees {missing}")
        return build_placement(trees, [self.owned[index[t.id]] for t in trees], self.world_size)


def footprint(tree: TrajectoryTree, trajectories: Collection[int]) -> frozenset[int]:
    """Nodes that replaying these trajectories runs: every node on the path of each of their calls."""
    nodes: set[int] = set()
    for t in trajectories:
        for call in tree.records[t].calls:
            nodes.update(tree.path(call.end))
    return frozenset(nodes)


def tokens(tree: TrajectoryTree, nodes: Collection[int]) -> int:
    return sum(len(tree.nodes[n]) for n in nodes)


def build_placement(
    trees: Sequence[TrajectoryTree], owned: Sequence[Sequence[Collection[int]]], world_size: int
) -> Placement:
    """A `Placement` from explicit per-tree, per-rank trajectory sets; checks each is owned exactly once."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(owned) != len(trees):
        raise ValueError(f"{len(owned)} ownership lists for {len(trees)} trees")
    rank_tokens = [0] * world_size
    unique = 0
    frozen: list[tuple[frozenset[int], ...]] = []
    for tree, per_rank in zip(trees, owned):
        if len(per_rank) != world_size:
            raise ValueError(f"tree {tree.id[:12]}: {len(per_rank)} rank entries for world size {world_size}")
        sets = tuple(frozenset(s) for s in per_rank)
        seen = [t for s in sets for t in s]
        everything = set(range(len(tree.records)))
        if sorted(seen) != sorted(everything):
            doubled = sorted({t for t in seen if seen.count(t) > 1})
            missing = sorted(everything - set(seen))
            raise ValueError(
                f"tree {tree.id[:12]}: every trajectory must be owned by exactly one rank "
                f"(doubled {doubled}, missing {missing})"
            )
        for rank, s in enumerate(sets):
            rank_tokens[rank] += tokens(tree, footprint(tree, s))
        unique += tokens(tree, footprint(tree, everything))
        frozen.append(sets)
    return Placement(world_size, tuple(t.id for t in trees), tuple(frozen), tuple(rank_tokens), unique)


def round_robin(trees: Sequence[TrajectoryTree], world_size: int) -> Placement:
    """The naive baseline: trajectory j of the flattened list goes to rank j mod world_size."""
    owned: list[list[set[int]]] = []
    j = 0
    for tree in trees:
        per_rank: list[set[int]] = [set() for _ in range(world_size)]
        for t in range(len(tree.records)):
            per_rank[j % world_size].add(t)
            j += 1
        owned.append(per_rank)
    return build_placement(trees, owned, world_size)


@dataclass(frozen=True)
class _Piece:
    tree: int
    node: int
    """The subtree root the piece hangs from (its trajectories all pass through it)."""
    trajectories: tuple[int, ...]


def _deepest_end(tree: TrajectoryTree, t: int) -> int:
    return max((c.end for c in tree.records[t].calls), key=lambda n: (len(tree.path(n)), n))


def _split(tree: TrajectoryTree, piece: _Piece) -> list[_Piece] | None:
    """Cut a piece at its first divergence below `piece.node`; None when it is a single trajectory."""
    if len(piece.trajectories) < 2:
        return None
    ends = {t: tree.path(_deepest_end(tree, t)) for t in piece.trajectories}
    depth = len(tree.path(piece.node))
    while True:
        branch: dict[int, list[int]] = {}
        for t, path in ends.items():
            branch.setdefault(path[depth] if depth < len(path) else -1, []).append(t)
        if len(branch) > 1:
            return [
                _Piece(piece.tree, n if n >= 0 else piece.node, tuple(ts)) for n, ts in sorted(branch.items())
            ]
        (only,) = branch
        if only < 0:  # identical paths: split the trajectories themselves
            return [_Piece(piece.tree, piece.node, (t,)) for t in piece.trajectories]
        depth += 1


def _assign(
    trees: Sequence[TrajectoryTree], pieces: Sequence[_Piece], world_size: int, cost: _Costs
) -> Placement:
    """Largest piece first, to the rank whose load after taking it is smallest (ties: less duplication)."""
    order = sorted(pieces, key=lambda p: (-cost.tokens(p), p.tree, p.node, p.trajectories))
    load = [0] * world_size
    have: list[dict[int, frozenset[int]]] = [{} for _ in range(world_size)]
    owned: list[list[set[int]]] = [[set() for _ in range(world_size)] for _ in trees]
    for p in order:
        tree = trees[p.tree]
        nodes = cost.nodes(p)
        marginal = [tokens(tree, nodes - have[r].get(p.tree, frozenset())) for r in range(world_size)]
        rank = min(range(world_size), key=lambda r: (load[r] + marginal[r], marginal[r], r))
        load[rank] += marginal[rank]
        have[rank][p.tree] = have[rank].get(p.tree, frozenset()) | nodes
        owned[p.tree][rank].update(p.trajectories)
    return build_placement(trees, owned, world_size)


class _Costs:
    """Footprints and token costs of pieces, computed once each."""

    def __init__(self, trees: Sequence[TrajectoryTree]) -> None:
        self.trees = trees
        self._nodes: dict[_Piece, frozenset[int]] = {}

    def nodes(self, p: _Piece) -> frozenset[int]:
        if p not in self._nodes:
            self._nodes[p] = footprint(self.trees[p.tree], p.trajectories)
        return self._nodes[p]

    def tokens(self, p: _Piece) -> int:
        return tokens(self.trees[p.tree], self.nodes(p))


def place(trees: Sequence[TrajectoryTree], world_size: int) -> Placement:
    """Balance replay tokens over ranks while keeping subtrees together (see module docstring)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cost = _Costs(trees)
    pieces = [_Piece(i, ROOT, tuple(range(len(t.records)))) for i, t in enumerate(trees) if t.records]
    best = _assign(trees, pieces, world_size, cost)
    # Pieces much smaller than a rank's share cannot improve the balance further.
    grain = best.unique_tokens / (4 * world_size)
    splittable = list(pieces)
    while world_size > 1:
        candidates = sorted(splittable, key=lambda p: (-cost.tokens(p), p.tree, p.node, p.trajectories))
        cut = next(
            (
                (p, parts)
                for p in candidates
                if cost.tokens(p) > grain and (parts := _split(trees[p.tree], p)) is not None
            ),
            None,
        )
        if cut is None:
            break
        piece, parts = cut
        pieces = [q for q in pieces if q != piece] + parts
        splittable = [q for q in splittable if q != piece] + parts
        candidate = _assign(trees, pieces, world_size, cost)
        if (candidate.makespan, candidate.duplicated_tokens) < (best.makespan, best.duplicated_tokens):
            best = candidate
    return best
