"""The update manifest: exactly which trajectories one optimizer step contains, and their weights.

Normalization is computed here, from the manifest alone, never from how branches were split into
microbatches or ranks. A trajectory's coefficient multiplies each of its policy-token terms:

    token-mean             1 / (policy tokens of every trajectory in the manifest)
    seq-mean-token-mean    1 / (trajectories in the manifest x this trajectory's policy tokens)
    seq-mean-token-sum     1 / (trajectories in the manifest x seq_sum_normalizer)

Example:
    >>> from treetrain.loss.loss_config import LossConfig
    >>> m = Manifest(0, (ManifestEntry("t", "a", 1, 3), ManifestEntry("t", "b", 1, 1)))
    >>> m.coefficient("t", "a", LossConfig()), m.coefficient("t", "a", LossConfig(aggregation="seq-mean-token-mean"))
    (0.25, 0.16666666666666666)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from treetrain.errors import TreetrainError
from treetrain.loss.loss_config import LossConfig
from treetrain.tree.trajectory_tree import TrajectoryTree


class ManifestError(TreetrainError, RuntimeError):
    """The contributions of an update do not match its manifest; the step is refused."""


@dataclass(frozen=True, order=True)
class ManifestEntry:
    """One trajectory of the update."""

    tree_id: str
    trajectory_id: str
    num_calls: int
    policy_tokens: int
    """Owned policy tokens over all calls (each counted once)."""


@dataclass(frozen=True, order=True)
class ContributionKey:
    """The unit of exactly-once accounting: one call of one trajectory at one model version."""

    version: int
    tree_id: str
    trajectory_id: str
    call: int


@dataclass(frozen=True)
class Manifest:
    """The set of trajectories one optimizer step must contain, at one model version."""

    version: int
    entries: tuple[ManifestEntry, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(sorted(self.entries)))
        keys = [(e.tree_id, e.trajectory_id) for e in self.entries]
        if len(set(keys)) != len(keys):
            raise ManifestError("manifest lists a trajectory twice")

    @staticmethod
    def build(trees: Iterable[TrajectoryTree], version: int) -> Manifest:
        entries = []
        for tree in trees:
            owned = tree.owned_policy_tokens()
            for ti, rec in enumerate(tree.records):
                entries.append(ManifestEntry(tree.id, rec.id, len(rec.calls), owned[ti]))
        return Manifest(version, tuple(entries))

    @cached_property
    def digest(self) -> str:
        h = hashlib.sha256(f"v{self.version}".encode())
        for e in self.entries:
            h.update(f"|{e.tree_id}|{e.trajectory_id}|{e.num_calls}|{e.policy_tokens}".encode())
        return h.hexdigest()

    @cached_property
    def _index(self) -> dict[tuple[str, str], ManifestEntry]:
        return {(e.tree_id, e.trajectory_id): e for e in self.entries}

    @property
    def num_trajectories(self) -> int:
        return len(self.entries)

    @cached_property
    def policy_tokens(self) -> int:
        """Owned policy tokens over all entries (cached: every token-mean coefficient reads it)."""
        return sum(e.policy_tokens for e in self.entries)

    @property
    def tree_ids(self) -> tuple[str, ...]:
        return tuple(sorted({e.tree_id for e in self.entries}))

    def contains(self, tree_id: str, trajectory_id: str) -> bool:
        return (tree_id, trajectory_id) in self._index

    def keys(self) -> tuple[ContributionKey, ...]:
        return tuple(
            ContributionKey(self.version, e.tree_id, e.trajectory_id, c)
            for e in self.entries
            for c in range(e.num_calls)
        )

    def coefficient(self, tree_id: str, trajectory_id: str, cfg: LossConfig) -> float:
        """Weight of each policy-token term of this trajectory; 0 when it is not in the manifest."""
        entry = self._index.get((tree_id, trajectory_id))
        if entry is None or entry.policy_tokens == 0:
            return 0.0
        if cfg.aggregation == "token-mean":
            return 1.0 / self.policy_tokens
        if cfg.aggregation == "seq-mean-token-mean":
            return 1.0 / (self.num_trajectories * entry.policy_tokens)
        return 1.0 / (self.num_trajectories * cfg.seq_sum_normalizer)

    def restricted_to(self, tree_ids: Sequence[str]) -> Manifest:
        """The same version with only the given trees (e.g. after a group is dropped whole)."""
        keep = set(tree_ids)
        return Manifest(self.version, tuple(e for e in self.entries if e.tree_id in keep))
