"""Several trainer ranks on one fleet of `vllm serve` processes: rank 0 leads each weight sync.

Every rank is a client of the same servers and samples its own share of an update's tasks; the servers
batch what all of them send. The weights are written and loaded once per sync, by rank 0, and the other
ranks follow:

- every rank runs what the write runs on the model (the probe forward, then each bucket's gather): under
  ZeRO-3 those are collectives of the whole world, so the model is gathered one bucket at a time, on every
  rank, and is never whole anywhere;
- rank 0 writes the buckets and loads them into every serving server; then it shares its outcome (a
  collective, `SyncOutcome`): the directory the servers loaded, their version label, the servers it found
  serving, or the one line that stopped it;
- a follower takes that outcome: it stops with rank 0's line, marks the servers rank 0 lost as lost, reads
  every server's version against the label, and goes on at the same version as rank 0.

A follower reloads a lost server that answers again from the files rank 0 wrote (the run directory is
shared by every rank), and never removes them.

Example:
    >>> outcome = SyncOutcome(path="/run/engine-weights/current", label="/run/engine-weights@3", alive=(0, 1))
    >>> SyncOutcome.decode(outcome.encode()) == outcome
    True
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerRanks:
    """The trainer's processes, each a client of the fleet."""

    rank: int
    world_size: int
    gather: Callable[[str], list[str]]
    """Every rank's text, indexed by rank (a collective of the trainer's backend)."""

    @property
    def leads(self) -> bool:
        """Whether this rank writes and loads the weights (rank 0)."""
        return self.rank == 0


@dataclass(frozen=True)
class SyncOutcome:
    """What rank 0's sync left on the servers, as every rank needs it."""

    path: str | None = None
    """The directory the servers loaded (the full weights, or the current adapter)."""
    label: str | None = None
    """The weight version label every serving server holds."""
    alive: tuple[int, ...] = ()
    """The servers (indices into `rollout.vllm.urls`) that serve after the sync."""
    adapter: str | None = None
    """The served adapter's name, when LoRA is served as an adapter."""
    error: str | None = None
    """The one line that stopped rank 0's sync (None: it succeeded)."""

    def encode(self) -> str:
        return json.dumps(
            {"path": self.path, "label": self.label, "alive": list(self.alive), "adapter": self.adapter,
             "error": self.error}
        )  # fmt: skip

    @staticmethod
    def decode(text: str) -> SyncOutcome:
        """Rank 0's outcome, as it encoded it (the trainer's own ranks: trusted)."""
        d = json.loads(text)
        return SyncOutcome(d["path"], d["label"], tuple(int(i) for i in d["alive"]), d["adapter"], d["error"])


def share_outcome(ranks: TrainerRanks, outcome: SyncOutcome | None) -> SyncOutcome:
    """Rank 0's `outcome`, on every rank (a collective; followers pass None)."""
    return SyncOutcome.decode(ranks.gather(outcome.encode() if outcome is not None else "")[0])
