"""The replay engine: flat reference, scoring pass, resident KV and tree replay.

Names load on first use (PEP 562), so that the torch-free modules (`schedule`, `units`) can be read by the
config without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treetrain.lazy import lazy_names

if TYPE_CHECKING:
    from treetrain.replay.batch import ReplayConfig, ReplayReport, TreeWork, UpdateBatch
    from treetrain.replay.flat_reference import FlatReference
    from treetrain.replay.replay_schedule import ReplaySchedule
    from treetrain.replay.resident import ResidentIdentity, ResidentStore, StaleResidentStateError
    from treetrain.replay.tree_replay import BackwardFailed, TreeReplay

_LAZY = {
    "ReplayConfig": "treetrain.replay.batch",
    "ReplayReport": "treetrain.replay.batch",
    "TreeWork": "treetrain.replay.batch",
    "UpdateBatch": "treetrain.replay.batch",
    "FlatReference": "treetrain.replay.flat_reference",
    "BackwardFailed": "treetrain.replay.tree_replay",
    "TreeReplay": "treetrain.replay.tree_replay",
    "ReplaySchedule": "treetrain.replay.replay_schedule",
    "ResidentIdentity": "treetrain.replay.resident",
    "ResidentStore": "treetrain.replay.resident",
    "StaleResidentStateError": "treetrain.replay.resident",
}

__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "BackwardFailed",
    "FlatReference",
    "ReplayConfig",
    "ReplayReport",
    "ReplaySchedule",
    "ResidentIdentity",
    "ResidentStore",
    "StaleResidentStateError",
    "TreeReplay",
    "TreeWork",
    "UpdateBatch",
]
