"""Distributed training: placement over ranks, exactly-once coverage, and training backends.

`DeepSpeedBackend` lives in `treetrain.distributed.deepspeed_backend` and is imported from there, so that
importing this package does not import DeepSpeed.
"""

from treetrain.distributed.backend import AgreementError, OptimizerConfig, TorchBackend, TrainBackend
from treetrain.distributed.checkpoint_io import CheckpointError
from treetrain.distributed.coverage import CoverageClaims, DuplicateContributionError
from treetrain.distributed.placement import Placement, build_placement, place, round_robin

__all__ = [
    "AgreementError",
    "CheckpointError",
    "CoverageClaims",
    "DuplicateContributionError",
    "OptimizerConfig",
    "Placement",
    "TorchBackend",
    "TrainBackend",
    "build_placement",
    "place",
    "round_robin",
]
