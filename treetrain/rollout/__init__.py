"""Rollouts: sampling trees of episodes from the current policy, and importing externally sampled ones."""

from treetrain.rollout.sampler import PrefixState, Sample, Sampler, SamplerConfig, SamplerStats, fork_cache
from treetrain.rollout.schedule import FanOut
from treetrain.rollout.tree_rollout import RolloutConfig, RolloutResult, rollout_trees

__all__ = [
    "FanOut",
    "PrefixState",
    "RolloutConfig",
    "RolloutResult",
    "Sample",
    "Sampler",
    "SamplerConfig",
    "SamplerStats",
    "fork_cache",
    "rollout_trees",
]
