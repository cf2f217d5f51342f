"""Rollouts: sampling trees of episodes from the current policy, and importing externally sampled ones.

The names below load on first use, so that `treetrain.rollout.importer` (the import command) does not pull
in torch and transformers through this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treetrain.lazy import lazy_names

if TYPE_CHECKING:
    from treetrain.rollout.fanout import FanOut
    from treetrain.rollout.prefix_sampler import (
        PrefixState,
        Sample,
        Sampler,
        SamplerConfig,
        SamplerStats,
        fork_cache,
    )
    from treetrain.rollout.sampling import Sampling
    from treetrain.rollout.tree_rollout import RolloutConfig, RolloutResult, rollout_trees

_WHERE = {
    "FanOut": "fanout",
    "PrefixState": "prefix_sampler",
    "RolloutConfig": "tree_rollout",
    "RolloutResult": "tree_rollout",
    "Sample": "prefix_sampler",
    "Sampler": "prefix_sampler",
    "SamplerConfig": "prefix_sampler",
    "SamplerStats": "prefix_sampler",
    "Sampling": "sampling",
    "fork_cache": "prefix_sampler",
    "rollout_trees": "tree_rollout",
}
__all__ = [
    "FanOut",
    "PrefixState",
    "RolloutConfig",
    "RolloutResult",
    "Sample",
    "Sampler",
    "SamplerConfig",
    "SamplerStats",
    "Sampling",
    "fork_cache",
    "rollout_trees",
]

__getattr__ = lazy_names(__name__, {name: f"treetrain.rollout.{module}" for name, module in _WHERE.items()})
