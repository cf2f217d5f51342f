"""Distributed training: placement over ranks, exactly-once coverage, and training backends.

Names load on first use (PEP 562), so that `treetrain.distributed.optim_config` can be read by the config
without importing torch. `DeepSpeedBackend` lives in `treetrain.distributed.deepspeed_backend` and is
imported from there, so that using this package does not import DeepSpeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treetrain.lazy import lazy_names

if TYPE_CHECKING:
    from treetrain.distributed.backend import AgreementError, TorchBackend, TrainBackend
    from treetrain.distributed.checkpoint_io import CheckpointError
    from treetrain.distributed.coverage import CoverageClaims, DuplicateContributionError
    from treetrain.distributed.optim_config import OptimizerConfig
    from treetrain.distributed.placement import Placement, build_placement, place, round_robin

_LAZY = {
    "AgreementError": "treetrain.distributed.backend",
    "TorchBackend": "treetrain.distributed.backend",
    "TrainBackend": "treetrain.distributed.backend",
    "CheckpointError": "treetrain.distributed.checkpoint_io",
    "CoverageClaims": "treetrain.distributed.coverage",
    "DuplicateContributionError": "treetrain.distributed.coverage",
    "OptimizerConfig": "treetrain.distributed.optim_config",
    "Placement": "treetrain.distributed.placement",
    "build_placement": "treetrain.distributed.placement",
    "place": "treetrain.distributed.placement",
    "round_robin": "treetrain.distributed.placement",
}

__getattr__ = lazy_names(__name__, _LAZY)


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
