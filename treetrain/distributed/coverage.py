"""Exactly-once accounting: which manifest contributions the current update window holds.

Every contribution is a `ContributionKey(version, tree, trajectory, call)`. A rank's `CoverageClaims` knows
the keys placement gave it. A replay first *claims* its keys (a key already covered or in flight is refused:
running it twice would double count), then *commits* them once its gradient is in, or *releases* them when
the attempt failed before any gradient was accumulated. Resetting the window uncovers everything.

Across ranks only a summary moves: the number of covered keys and their multiset hash (a sum of 64-bit key
hashes). The sums over ranks equal the manifest's exactly when every key is covered once, with a
negligible chance of a collision; a key covered twice, on one rank or on two, or not at all, changes the
count or the hash. Only on a mismatch are the key lists gathered, to name what is missing or doubled.

Example:
    >>> key = ContributionKey(0, "tree", "t0", 0)
    >>> claims = CoverageClaims([key])
    >>> claims.claim([key]); claims.commit([key]); claims.complete
    True
    >>> claims.claim([key])
    Traceback (most recent call last):
    ...
    treetrain.distributed.coverage.DuplicateContributionError: contribution (version 0, tree tree, trajectory t0, call 0) is already covered in this update window; a second replay would count it twice
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from treetrain.loss.manifest import ContributionKey, ManifestError

_MASK = (1 << 64) - 1


class DuplicateContributionError(ManifestError):
    """A contribution was requested again after it was covered (or while it is being replayed)."""


def describe(key: ContributionKey) -> str:
    return (
        f"(version {key.version}, tree {key.tree_id[:12]}, trajectory {key.trajectory_id}, call {key.call})"
    )


def key_hash(key: ContributionKey) -> int:
    text = f"{key.version}|{key.tree_id}|{key.trajectory_id}|{key.call}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


@dataclass(frozen=True)
class CoverageSummary:
    """What one rank covered: how many keys and their multiset hash."""

    count: int
    hash: int

    @staticmethod
    def of(keys: Iterable[ContributionKey]) -> CoverageSummary:
        n, h = 0, 0
        for key in keys:
            n += 1
            h = (h + key_hash(key)) & _MASK
        return CoverageSummary(n, h)

    def plus(self, other: CoverageSummary) -> CoverageSummary:
        return CoverageSummary(self.count + other.count, (self.hash + other.hash) & _MASK)

    def encode(self) -> str:
        return f"{self.count}:{self.hash:016x}"

    @staticmethod
    def decode(text: str) -> CoverageSummary:
        count, _, h = text.partition(":")
        return CoverageSummary(int(count), int(h, 16))


class CoverageClaims:
    """The keys one rank must cover in this window, and which of them it has."""

    def __init__(self, expected: Iterable[ContributionKey]) -> None:
        self.expected = frozenset(expected)
        self._covered: set[ContributionKey] = set()
        self._claimed: set[ContributionKey] = set()

    def claim(self, keys: Sequence[ContributionKey]) -> None:
        """Reserve keys for one replay; refuses any already covered, in flight, or not this rank's."""
        for key in keys:
            if key in self._covered or key in self._claimed:
                raise DuplicateContributionError(
                    f"contribution {describe(key)} is already covered in this update window; "
                    "a second replay would count it twice"
                )
            if key not in self.expected:
                raise ManifestError(
                    f"contribution {describe(key)} is not part of this rank's share of the manifest"
                )
        if len(set(keys)) != len(keys):
            raise DuplicateContributionError("one replay request lists the same contribution twice")
        self._claimed.update(keys)

    def commit(self, keys: Sequence[ContributionKey]) -> None:
        """The claimed keys' gradient is accumulated."""
        for key in keys:
            if key not in self._claimed:
                raise ManifestError(f"contribution {describe(key)} committed without a claim")
        self._claimed.difference_update(keys)
        self._covered.update(keys)

    def release(self, keys: Sequence[ContributionKey]) -> None:
        """The attempt failed before accumulating anything: the keys are missing again."""
        self._claimed.difference_update(keys)

    def reset(self) -> None:
        """The window's gradients were discarded: nothing is covered any more."""
        self._covered.clear()
        self._claimed.clear()

    def is_covered(self, keys: Iterable[ContributionKey]) -> bool:
        return all(k in self._covered for k in keys)

    @property
    def covered(self) -> frozenset[ContributionKey]:
        return frozenset(self._covered)

    def missing(self) -> tuple[ContributionKey, ...]:
        return tuple(sorted(self.expected - self._covered))

    @property
    def complete(self) -> bool:
        return not self._claimed and self._covered == self.expected

    def summary(self) -> CoverageSummary:
        return CoverageSummary.of(self._covered)


def check_coverage(summaries: Sequence[str], manifest_keys: Sequence[ContributionKey]) -> bool:
    """True when the ranks' summaries add up to the manifest exactly (see module docstring)."""
    total = CoverageSummary(0, 0)
    for s in summaries:
        total = total.plus(CoverageSummary.decode(s))
    return total == CoverageSummary.of(manifest_keys)


def require_coverage(
    gather: Callable[[str], list[str]],
    claims: CoverageClaims,
    manifest_keys: Sequence[ContributionKey],
    *,
    context: int = 1,
) -> None:
    """Collective (`gather` is the backend's): every manifest key covered exactly once over all ranks, or
    `ManifestError` naming what is missing or doubled, and the optimizer step is refused. With context groups
    of `context` consecutive ranks, which replay the same trees in lockstep, each group counts once, after
    its ranks are checked to have covered the same contributions."""
    if check_coverage(group_leads(gather(claims.summary().encode()), context), manifest_keys):
        return
    per_rank = [decode_keys(t) for t in group_leads(gather(encode_keys(claims.covered)), context)]
    raise ManifestError(
        f"coverage check failed, the optimizer step is refused: {explain_mismatch(per_rank, manifest_keys)}"
    )


def group_leads(per_rank: list[str], context: int) -> list[str]:
    """The first rank's entry of each context group of `context` consecutive ranks, after checking that the
    group's other ranks covered the same contributions."""
    odd = [r for r, text in enumerate(per_rank) if text != per_rank[r - r % context]]
    if odd:
        raise ManifestError(
            f"coverage check failed, the optimizer step is refused: ranks {odd} covered other contributions "
            "than the first rank of their context group"
        )
    return per_rank[::context]


def explain_mismatch(
    per_rank: Sequence[Sequence[ContributionKey]], manifest_keys: Sequence[ContributionKey]
) -> str:
    """Name the missing and doubled contributions, given every rank's covered keys."""
    owners: dict[ContributionKey, list[int]] = {}
    for rank, keys in enumerate(per_rank):
        for key in keys:
            owners.setdefault(key, []).append(rank)
    expected = set(manifest_keys)
    missing = sorted(expected - set(owners))
    doubled = sorted((k, r) for k, r in owners.items() if len(r) > 1)
    unknown = sorted(set(owners) - expected)
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing, e.g. {describe(missing[0])}")
    if doubled:
        key, ranks = doubled[0]
        parts.append(f"{len(doubled)} covered more than once, e.g. {describe(key)} on ranks {ranks}")
    if unknown:
        parts.append(f"{len(unknown)} not in the manifest, e.g. {describe(unknown[0])}")
    return "; ".join(parts) or "summaries disagree although the key lists match (hash collision)"


def encode_keys(keys: Iterable[ContributionKey]) -> str:
    return json.dumps([[k.version, k.tree_id, k.trajectory_id, k.call] for k in sorted(keys)])


def decode_keys(text: str) -> tuple[ContributionKey, ...]:
    return tuple(ContributionKey(int(v), str(t), str(j), int(c)) for v, t, j, c in json.loads(text))
