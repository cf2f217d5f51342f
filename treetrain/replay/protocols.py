"""What the replay engine tells its optional memory tracker, and the shape of a kept-graph choice.

The engine depends only on these; `treetrain.memory` implements them (`MemoryTracker`) and the planner
produces `KeepGraph` functions. Retention is not a collaborator: the planner hands the engine each tree's
evictions as data (`treetrain.replay.replay_schedule.TreeSchedule`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from treetrain.lifetime import ClassBytes
from treetrain.replay.resident import ResidentStore
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
