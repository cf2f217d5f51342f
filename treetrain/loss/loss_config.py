"""Loss configuration: PPO-clip / GRPO policy gradient, optional KL to a reference, entropy bonus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from treetrain.errors import ConfigError

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
RatioSource = Literal["scoring", "sampler"]
KLEstimator = Literal["k1", "k3"]

AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
RATIO_SOURCES: tuple[str, ...] = ("scoring", "sampler")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")


@dataclass(frozen=True)
class LossConfig:
    """How per-token terms become one scalar. Validated at construction.

    Example:
        >>> LossConfig(aggregation="seq-mean-token-sum", kl_coef=0.01).kl_estimator
        'k3'
    """

    clip_low: float = 0.2
    """PPO ratio clip below 1 (ratio is clipped to [1 - clip_low, 1 + clip_high])."""
    clip_high: float = 0.2
    """PPO ratio clip above 1; DAPO's clip-higher uses a larger value than clip_low."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (None disables)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model (needs a reference model when > 0)."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator per token: k1 = log p - log q_ref, k3 = exp(ref - logp) - (ref - logp) - 1."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    aggregation: Aggregation = "token-mean"
    """token-mean: mean over every policy token of the update; seq-mean-token-mean: mean over trajectories of
    each trajectory's token mean; seq-mean-token-sum (Dr. GRPO): mean over trajectories of token sums."""
    seq_sum_normalizer: float = 1.0
    """Constant divisor for seq-mean-token-sum (Dr. GRPO uses the maximum response length)."""
    ratio_source: RatioSource = "scoring"
    """Old logprobs for the ratio: the no-grad scoring pass of the current policy, or the sampler's own."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ConfigError(f"loss.clip_low must be in [0, 1), got {self.clip_low!r}")
        if not self.clip_high >= 0.0:
            raise ConfigError(f"loss.clip_high must be >= 0, got {self.clip_high!r}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"loss.dual_clip must be > 1 (or None), got {self.dual_clip!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ConfigError("loss.kl_coef and loss.entropy_coef must be >= 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"loss.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"loss.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.ratio_source not in RATIO_SOURCES:
            raise ConfigError(f"loss.ratio_source must be one of {RATIO_SOURCES}, got {self.ratio_source!r}")
        if not self.seq_sum_normalizer > 0:
            raise ConfigError(f"loss.seq_sum_normalizer must be > 0, got {self.seq_sum_normalizer!r}")

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0

    @property
    def zero_advantage_is_inert(self) -> bool:
        """With no KL and no entropy term, a token whose advantages are all zero contributes exactly nothing."""
        return self.kl_coef == 0 and self.entropy_coef == 0
