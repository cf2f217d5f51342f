"""How stale the tokens an update trains on are, token by token, and which groups break the bound.

A policy token's *lag* is the trainer's weight version when the update trains on it minus the version that
sampled it (`Segment.version`). `rollout.max_staleness = K` promises lag <= K for every trained token; the
pacing of the sampler keeps that true (`treetrain.rollout.sources.async_source`), and `split_stale` checks it once
more, token by token, when an update takes its trees: a group with any token over the bound is dropped whole
(a group is normalized together, so it is kept or dropped whole) and its tokens are counted. Tokens are
counted per trajectory (a shared prefix counts once for each trajectory through it, as the flat loss sees
it), by position, so a later call that repeats an earlier turn does not count it twice; tokens that record
no version (imported trees) are left out.

Example:
    >>> from treetrain.trajectory import Call, Role, Segment, Trajectory
    >>> from treetrain.tree import build_tree
    >>> turn = lambda v: Call((Segment(Role.PROMPT, (1, 2)), Segment(Role.POLICY, (3, 4), (-0.1, -0.2), v)))
    >>> tree = build_tree([Trajectory("a", (turn(3),), 1.0), Trajectory("b", (turn(1),), 0.0)])
    >>> lags = Staleness.of(tree, version=4)
    >>> lags.histogram, lags.least, lags.most, lags.mean
    (((1, 2), (3, 2)), 1, 3, 2.0)
    >>> kept, dropped = split_stale([(tree,)], version=4, max_staleness=2)
    >>> kept, dropped.tokens, dropped.groups
    ((), 4, 1)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from treetrain.trajectory import Role
from treetrain.tree import TrajectoryTree


@dataclass(frozen=True)
class Staleness:
    """Policy tokens by version lag: `histogram` holds (lag, tokens) pairs, lag ascending."""

    histogram: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def of(tree: TrajectoryTree, version: int) -> Staleness:
        """The lags of `tree`'s policy tokens when trained at `version`."""
        counts: Counter[int] = Counter()
        for trajectory in tree.trajectories():
            at: dict[int, int] = {}  # position -> sampling version, over the trajectory's calls
            for call in trajectory.calls:
                pos = 0
                for seg in call.segments:
                    if seg.role is Role.POLICY and seg.version is not None:
                        for p in range(pos, pos + len(seg.tokens)):
                            at[p] = seg.version
                    pos += len(seg.tokens)
            counts.update(version - v for v in at.values())
        return Staleness(tuple(sorted(counts.items())))

    def merged(self, other: Staleness) -> Staleness:
        counts = Counter(dict(self.histogram))
        counts.update(dict(other.histogram))
        return Staleness(tuple(sorted(counts.items())))

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.histogram)

    @property
    def least(self) -> int | None:
        return self.histogram[0][0] if self.histogram else None

    @property
    def most(self) -> int | None:
        return self.histogram[-1][0] if self.histogram else None

    @property
    def mean(self) -> float | None:
        n = self.tokens
        return sum(lag * k for lag, k in self.histogram) / n if n else None


@dataclass(frozen=True)
class Dropped:
    """What `split_stale` left out: whole groups, and their policy tokens."""

    groups: int = 0
    tokens: int = 0


def split_stale(
    groups: Sequence[tuple[TrajectoryTree, ...]], version: int, max_staleness: int
) -> tuple[tuple[tuple[TrajectoryTree, ...], ...], Dropped]:
    """The groups whose every policy token has lag in [0, `max_staleness`] at `version`, and what was
    dropped. A negative lag (a token sampled by weights newer than the trainer's) breaks the bound too."""
    kept: list[tuple[TrajectoryTree, ...]] = []
    dropped = Dropped()
    for group in groups:
        lags = [Staleness.of(tree, version) for tree in group]
        bad = any(s.tokens and (s.least < 0 or s.most > max_staleness) for s in lags)  # type: ignore[operator]
        if bad:
            dropped = Dropped(dropped.groups + 1, dropped.tokens + sum(s.tokens for s in lags))
        else:
            kept.append(group)
    return tuple(kept), dropped
