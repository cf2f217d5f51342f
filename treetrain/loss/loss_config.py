"""Loss configuration: PPO-clip / GRPO policy gradient, optional KL to a reference, entropy bonus.

The policy the loss trains is softmax(logits / temperature), the distribution the sampler drew from, as in
TRL and verl: tokens sampled at temperature 0.7 are scored at 0.7 (the scoring pass, the replay, the flat
reference, the entropy and the KL reference alike), so the PPO ratio, the sampler correction and
`ratio_source='sampler'` compare like with like. The trainer takes the temperature from
`rollout.sampling.temperature` unless `temperature` is set (`LossConfig.at_temperature`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from treetrain.errors import ConfigError

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
RatioSource = Literal["scoring", "sampler"]
KLEstimator = Literal["k1", "k3"]
SamplerCorrection = Literal["none", "token_truncate", "sequence_mask"]

AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
RATIO_SOURCES: tuple[str, ...] = ("scoring", "sampler")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")
SAMPLER_CORRECTIONS: tuple[str, ...] = ("none", "token_truncate", "sequence_mask")


@dataclass(frozen=True)
class LossConfig:
    """How per-token terms become one scalar. Validated at construction.

    Example:
        >>> LossConfig(aggregation="seq-mean-token-sum", kl_coef=0.01).kl_estimator
        'k3'
        >>> LossConfig().at_temperature(0.7).logit_temperature, LossConfig().logit_temperature
        (0.7, 1.0)
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
    sampler_correction: SamplerCorrection = "none"
    """Sampler/trainer mismatch correction (treetrain.loss.sampler_correction), with w = exp(scoring - sampler)
    per token: none; token_truncate multiplies each token's policy-gradient term by min(w, cap);
    sequence_mask drops the policy-gradient terms of a trajectory whose product of w is outside
    [1/cap, cap]. Needs ratio_source='scoring', top_p 1, and the loss at the sampling temperature."""
    sampler_correction_cap: float = 2.0
    """The cap C of sampler_correction (> 1; TRL's vllm_importance_sampling_cap and verl's
    rollout_is_threshold default to 2)."""
    temperature: float | None = None
    """Temperature of the policy the loss trains: logits are divided by it before the log-softmax in scoring,
    replay, entropy and the KL reference (as TRL and verl do). null: the sampling temperature
    (rollout.sampling.temperature) in a run, 1 in the Python API; another value trains a policy other than
    the one that sampled, and a sampler correction or ratio_source='sampler' refuses it."""

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
        if self.sampler_correction not in SAMPLER_CORRECTIONS:
            raise ConfigError(
                f"must be one of {SAMPLER_CORRECTIONS}, got {self.sampler_correction!r}",
                field="sampler_correction",
            )
        cap = self.sampler_correction_cap
        if (
            isinstance(cap, bool)
            or not isinstance(cap, int | float)
            or not (math.isfinite(cap) and cap > 1.0)
        ):
            raise ConfigError(
                f"must be a finite number > 1 (a weight cap of 1 or less would scale or mask every token), "
                f"got {cap!r}",
                field="sampler_correction_cap",
            )
        if self.sampler_correction != "none" and self.ratio_source != "scoring":
            raise ConfigError(
                f"{self.sampler_correction!r} weighs tokens by exp(scoring - sampler) logprobs, and "
                "ratio_source='sampler' has no scoring pass (its PPO ratio is already against the sampler); "
                "use ratio_source='scoring' or sampler_correction='none'",
                field="sampler_correction",
            )
        t = self.temperature
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t > 0)
        ):
            raise ConfigError(
                f"must be a finite number > 0, or null for the sampling temperature, got {t!r}",
                field="temperature",
            )
        if not self.seq_sum_normalizer > 0:
            raise ConfigError(f"loss.seq_sum_normalizer must be > 0, got {self.seq_sum_normalizer!r}")

    @property
    def logit_temperature(self) -> float:
        """What the engines divide the logits by: `temperature`, or 1 (the model's own distribution) when it
        is null. The trainer resolves null to the sampling temperature first (`at_temperature`)."""
        return 1.0 if self.temperature is None else float(self.temperature)

    def at_temperature(self, sampling: float) -> LossConfig:
        """This config for tokens sampled at temperature `sampling`: a null `temperature` becomes it, a set
        one stays."""
        return self if self.temperature is not None else replace(self, temperature=float(sampling))

    @property
    def corrects_sampler(self) -> bool:
        """Whether the policy-gradient terms are weighted by the sampler/trainer mismatch."""
        return self.sampler_correction != "none"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0

    @property
    def zero_advantage_is_inert(self) -> bool:
        """With no KL and no entropy term, a token whose advantages are all zero contributes exactly nothing,
        and the engine may skip it. Not under `sequence_mask`: such a token's logprob still decides whether
        the rest of its trajectory is masked, so it must be scored."""
        return self.kl_coef == 0 and self.entropy_coef == 0 and self.sampler_correction != "sequence_mask"
