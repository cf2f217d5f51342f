"""The one interface through which the trainer gets each update's trees: `TreeSource`.

Three sources implement it, and the trainer holds one of them without knowing which:

- `RolloutSource` (`sync_source`): `rollout.max_staleness = 0`; each update's trees are sampled on the
  training thread, between two optimizer steps, from the weights the last one left;
- `AsyncRolloutSource` (`async_source`): `rollout.max_staleness = K >= 1`; a sampler thread grows the next
  updates' trees while the current one trains, paced so that no token is more than K versions stale, with
  finished rollouts queued on disk (`tree_queue`) so that a run killed with kill -9 trains every update
  exactly once on resume;
- `RecordedSource` (`recorded_source`): `rollout.trees`; recorded tree files, consumed in order.

The trainer calls `produce` once per update, `trained` after its optimizer step, `serving` for a held-out
evaluation and `close` at the end; `waits_for` is what its progress bar says while `produce` runs. The
sampling sources are built by `open_source` from the run's settings and what the trainer hands over
(`SourceInputs`); the recorded one is built earlier, from the model's config alone, so that its trees are
checked before any model loads.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from treetrain.rollout.sources.produced import Produced
from treetrain.rollout.sources.run_settings import RunSettings, SourceInputs

if TYPE_CHECKING:
    from treetrain.rollout.engines.generation import GenerationEngine


class TreeSource(Protocol):
    """Where each update's trees come from (see the module docstring)."""

    @property
    def waits_for(self) -> str | None:
        """What the trainer waits for while `produce` runs, as its progress bar says it; None when the
        rollout samples in `produce` itself (the bar then counts its episodes)."""

    @property
    def one_sampler(self) -> bool:
        """Whether rank 0 samples every task, training's and evaluation's, and the other ranks none (an
        asynchronous run on a shared fleet of servers, whose `serving` has no engine on those ranks)."""

    def produce(self, model: Any, update: int, version: int) -> Produced:
        """Update `update`'s trees, every rank's, for a trainer whose weights are at `version` (a collective
        in a run of several ranks)."""

    def trained(self, update: int, model: Any, version: int) -> None:
        """Update `update` stepped the weights to `version`."""

    def serving(self, model: Any, version: int) -> AbstractContextManager[GenerationEngine]:
        """The rollout's engine at `model`'s weights of `version`, for a held-out evaluation."""

    def close(self) -> None:
        """Release the engine, its process and the sampler thread, if any."""


def open_source(cfg: RunSettings, inputs: SourceInputs) -> TreeSource:
    """The sampling source `cfg` asks for: asynchronous with `rollout.max_staleness` >= 1, else synchronous.
    Its engine is made here, so that an engine that cannot start stops the run before anything is sampled."""
    if cfg.rollout.max_staleness:
        from treetrain.rollout.sources.async_source import AsyncRolloutSource

        return AsyncRolloutSource(cfg, inputs)
    from treetrain.rollout.sources.sync_source import RolloutSource

    return RolloutSource(cfg, inputs)
