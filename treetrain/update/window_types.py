"""The data of an update: its retry bounds, its input (groups), what its replay did, and its report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from treetrain.errors import ConfigError
from treetrain.loss.advantages import AdvantageConfig, TreeAdvantages, compute_advantages
from treetrain.loss.sampler_correction import SamplerGap
from treetrain.replay import ReplayReport
from treetrain.tree.trajectory_tree import TrajectoryTree


@dataclass(frozen=True)
class WindowConfig:
    """Fault handling of an update: how often a tree is retried and a failing backward reset."""

    tree_attempts: int = 3
    """Tries of one tree that fails before any backward, before its group is marked failed."""
    window_attempts: int = 3
    """Window resets caused by one group's failing backward, before that group is marked failed."""

    def __post_init__(self) -> None:
        if self.tree_attempts < 1 or self.window_attempts < 1:
            raise ConfigError("window.tree_attempts and window.window_attempts must be >= 1")


@dataclass(frozen=True)
class Group:
    """Trees whose leaves are normalized together (one prompt's rollouts); kept or dropped whole."""

    trees: tuple[TrajectoryTree, ...]
    advantages: tuple[TreeAdvantages, ...]

    @staticmethod
    def build(trees: Sequence[TrajectoryTree], cfg: AdvantageConfig | None = None) -> Group:
        return Group(tuple(trees), compute_advantages(trees, cfg or AdvantageConfig()).trees)


@dataclass(frozen=True)
class DroppedGroup:
    """A group left out of the step, and why."""

    index: int
    tree_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Replayed:
    """What this rank's replay of an update did, retries and drops included (`treetrain.update.faults`)."""

    local: ReplayReport = field(default_factory=ReplayReport)
    """This rank's replay counters (the last, successful pass)."""
    tree_retries: int = 0
    window_resets: int = 0
    dropped: tuple[DroppedGroup, ...] = ()


@dataclass(frozen=True, kw_only=True)
class WindowReport:
    """What one committed update window did."""

    version: int
    """Model version after the commit: the number of committed windows. Bumped also when the step was
    skipped (`step_applied` False), so it always equals `Learner.version` afterwards."""
    manifest_digest: str
    contributions: int
    """Contribution keys in the final manifest (all ranks together)."""
    local: ReplayReport
    """This rank's replay counters (the last, successful pass)."""
    tree_retries: int
    window_resets: int
    dropped: tuple[DroppedGroup, ...]
    step_applied: bool
    """False when the optimizer skipped the update (DeepSpeed may, on overflow): the weights are unchanged but
    the version was still bumped and resident state invalidated (safe, merely wasteful)."""
    rank_tokens: tuple[int, ...] = ()
    """Replay tokens the final placement gave each rank (the same on every rank)."""
    sampler_gap: SamplerGap = field(default_factory=SamplerGap)
    """|scoring - sampler| logprob over the policy tokens of every rank (the same on every rank)."""

    @property
    def imbalance(self) -> float:
        """Cross-rank balance: max over mean of `rank_tokens` (1.0 is perfect; W when one rank does all).

        >>> WindowReport(version=1, manifest_digest="", contributions=0, local=ReplayReport(), tree_retries=0,
        ...              window_resets=0, dropped=(), step_applied=True, rank_tokens=(30, 10)).imbalance
        1.5
        """
        total = sum(self.rank_tokens)
        return max(self.rank_tokens) * len(self.rank_tokens) / total if total else 1.0
