"""The replay engine: flat reference, scoring pass, resident KV and tree replay.

Names load on first use (PEP 562), so that the torch-free modules (`schedule`, `units`) can be read by the
config without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treetrain.lazy import lazy_names

if TYPE_CHECKING:
    from treetrain.engine.batch import ReplayConfig, ReplayReport, TreeWork, UpdateBatch
    from treetrain.engine.flat_reference import FlatReference
    from treetrain.engine.replay import BackwardFailed, TreeReplay
    from treetrain.engine.replay_plan import ReplayPlan
    from treetrain.engine.resident import ResidentIdentity, ResidentStore, StaleResidentStateError

_LAZY = {
    "ReplayConfig": "treetrain.engine.batch",
    "ReplayReport": "treetrain.engine.batch",
    "TreeWork": "treetrain.engine.batch",
    "UpdateBatch": "treetrain.engine.batch",
    "FlatReference": "treetrain.engine.flat_reference",
    "BackwardFailed": "treetrain.engine.replay",
    "TreeReplay": "treetrain.engine.replay",
    "ReplayPlan": "treetrain.engine.replay_plan",
    "ResidentIdentity": "treetrain.engine.resident",
    "ResidentStore": "treetrain.engine.resident",
    "StaleResidentStateError": "treetrain.engine.resident",
}

__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "BackwardFailed",
    "FlatReference",
    "ReplayConfig",
    "ReplayPlan",
    "ReplayReport",
    "ResidentIdentity",
    "ResidentStore",
    "StaleResidentStateError",
    "TreeReplay",
    "TreeWork",
    "UpdateBatch",
]
