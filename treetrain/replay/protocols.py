"""What the replay engine tells its optional memory collaborators, as protocols.

The engine depends only on these; `treetrain.memory` implements them (`MemoryTracker`, `RetentionPolicy`)
and the planner produces `KeepGraph` functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from treetrain.lifetime import ClassBytes
from treetrain.replay.resident import ResidentStore
from treetrain.replay.schedule import ReplayStep
from treetrain.replay.scoring import ScoreEvent
from treetrain.replay.units import UnitTree

KeepGraph = Callable[[UnitTree], frozenset[int]]
"""Given a tree's units, the internal units whose first forward keeps its graph (`exact` mode)."""


class MemoryProbe(Protocol):
    """What the engine tells a memory tracker (`treetrain.memory.tracker.MemoryTracker`)."""

    active: bool

    def attach_model(self, model: torch.nn.Module) -> None: ...
    def attach_store(self, store: ResidentStore) -> None: ...
    def mark(self, label: str) -> None: ...
    def reset_peak(self) -> None: ...
    @property
    def peak(self) -> ClassBytes: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> Any: ...


class RetentionHook(Protocol):
    """What the engine tells a retention policy (`treetrain.memory.retention.RetentionPolicy`)."""

    def begin_tree(
        self,
        units: UnitTree,
        score_events: Sequence[ScoreEvent],
        steps: Sequence[ReplayStep],
        *,
        contract: str,
        keep: Sequence[bool],
        kept_graphs: frozenset[int],
        evict: Callable[[int], object],
        offload: Callable[[int], object],
        model: PreTrainedModel,
        fused_reference: bool = False,
    ) -> None: ...
    def before(self, event: object) -> None: ...
    def end_tree(self) -> int: ...
