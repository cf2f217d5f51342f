"""Distributed training: placement over ranks, the exactly-once update window, and training backends.

`DeepSpeedBackend` lives in `treetrain.distributed.deepspeed_backend` and is imported from there, so that
importing this package does not import DeepSpeed.
"""

from treetrain.distributed.backend import AgreementError, OptimizerConfig, TorchBackend, TrainBackend
from treetrain.distributed.checkpoint_io import CheckpointError
from treetrain.distributed.coverage import CoverageLedger, DuplicateContributionError
from treetrain.distributed.placement import Placement, build_placement, place, round_robin
from treetrain.distributed.window import (
    DroppedGroup,
    Group,
    OpenWindow,
    UpdateWindow,
    WindowConfig,
    WindowReport,
)

__all__ = [
    "AgreementError",
    "CheckpointError",
    "CoverageLedger",
    "DroppedGroup",
    "DuplicateContributionError",
    "Group",
    "OpenWindow",
    "OptimizerConfig",
    "Placement",
    "TorchBackend",
    "TrainBackend",
    "UpdateWindow",
    "WindowConfig",
    "WindowReport",
    "build_placement",
    "place",
    "round_robin",
]
