"""Coverage claims and the cross-rank coverage summary: every contribution exactly once."""

from __future__ import annotations

import re

import pytest

from treetrain.distributed.coverage import (
    CoverageClaims,
    CoverageSummary,
    DuplicateContributionError,
    check_coverage,
    decode_keys,
    encode_keys,
    explain_mismatch,
)
from treetrain.loss.manifest import ContributionKey, ManifestError

KEYS = [ContributionKey(3, "tree", f"t{i}", c) for i in range(4) for c in range(2)]


def test_claim_commit_release_reset() -> None:
    claims = CoverageClaims(KEYS)
    claims.claim(KEYS[:2])
    assert not claims.complete and claims.missing() == tuple(sorted(KEYS))
    with pytest.raises(DuplicateContributionError, match="already covered"):
        claims.claim(KEYS[1:3])  # in flight counts as covered
    claims.commit(KEYS[:2])
    claims.claim(KEYS[2:4])
    claims.release(KEYS[2:4])  # failed before any gradient: missing again
    assert claims.missing() == tuple(sorted(KEYS[2:]))
    claims.claim(KEYS[2:])
    claims.commit(KEYS[2:])
    assert claims.complete and claims.is_covered(KEYS)
    with pytest.raises(DuplicateContributionError, match=r"trajectory t0, call 0\) is already covered"):
        claims.claim(KEYS[:1])
    claims.reset()
    assert claims.missing() == tuple(sorted(KEYS)) and not claims.covered


def test_refuses_foreign_and_repeated_keys() -> None:
    claims = CoverageClaims(KEYS[:4])
    with pytest.raises(ManifestError, match="not part of this rank's share"):
        claims.claim([KEYS[5]])
    with pytest.raises(DuplicateContributionError, match="same contribution twice"):
        claims.claim([KEYS[0], KEYS[0]])
    with pytest.raises(ManifestError, match="without a claim"):
        claims.commit([KEYS[1]])


def _summaries(*ranks: list[ContributionKey]) -> list[str]:
    return [CoverageSummary.of(r).encode() for r in ranks]


def test_global_summary_accepts_exact_cover_in_any_split() -> None:
    assert check_coverage(_summaries(KEYS[:3], KEYS[3:]), KEYS)
    assert check_coverage(_summaries(KEYS[::2], [], KEYS[1::2]), KEYS)
    assert CoverageSummary.decode(CoverageSummary.of(KEYS).encode()) == CoverageSummary.of(KEYS)


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        (
            (KEYS[:4], KEYS[3:]),
            r"1 covered more than once, e.g. \(version 3, tree tree, trajectory t1, call 1\) on ranks \[0, 1\]",
        ),
        ((KEYS[:3], KEYS[4:]), r"1 missing, e.g. \(version 3, tree tree, trajectory t1, call 1\)"),
        ((KEYS[:3] + KEYS[4:5], KEYS[4:]), "1 missing.*1 covered more than once"),  # same count, other keys
        ((KEYS, [ContributionKey(2, "tree", "t0", 0)]), "1 not in the manifest"),  # a stale version
    ],
    ids=["doubled", "missing", "swapped", "stale-version"],
)
def test_global_summary_refuses_wrong_cover(ranks: tuple[list[ContributionKey], ...], message: str) -> None:
    assert not check_coverage(_summaries(*ranks), KEYS)
    explained = explain_mismatch(ranks, KEYS)
    assert re.search(message, explained), explained


def test_keys_round_trip_as_json() -> None:
    assert decode_keys(encode_keys(KEYS)) == tuple(sorted(KEYS))
