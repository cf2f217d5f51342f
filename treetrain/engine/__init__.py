"""The replay engine: flat reference, scoring pass, resident KV and tree replay."""

from treetrain.engine.batch import ReplayConfig, ReplayReport, TreeWork, UpdateBatch
from treetrain.engine.flat_reference import FlatReference
from treetrain.engine.replay import BackwardFailed, TreeReplay
from treetrain.engine.replay_plan import ReplayPlan
from treetrain.engine.resident import ResidentIdentity, ResidentStore, StaleResidentStateError

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
