"""The sampler/trainer logprob mismatch: how large it is (`SamplerGap`), and the correction of the loss for it.

Rollouts from an inference engine (vLLM, SGLang) record the sampler's logprob of every policy token. Under
the same weights the trainer computes a slightly different one (other kernels, precision, batching), so the
tokens were drawn from a distribution other than the one the PPO ratio takes as the old policy: the update
is slightly off-policy. Per policy token, with logp_trainer the scoring pass's old logprob (no graph) and
logp_sampler the recorded one,

    gap = |logp_trainer - logp_sampler|,        w = exp(logp_trainer - logp_sampler)  (detached).

`SamplerGap` is the measure the trainer logs per update (`sampler_logprob_gap_mean` / `_max`). The engines
record the logprob of the distribution they drew from, softmax(logits / T), and the loss scores at the same
T (`LossConfig.logit_temperature`), so both quantities measure the mismatch at any temperature. Not under
top_p below 1: the recorded logprob is then of the renormalised nucleus, which the trainer does not score,
and the gap holds the log of the nucleus's mass (the trainer refuses a correction with top_p below 1).

The correction is truncated importance sampling (Yao et al., "Your efficient RL framework secretly brings you
off-policy RL training", 2025). Its weight multiplies each token's **policy-gradient** term only; the KL and
entropy terms are regularizers of the current policy, not estimates under the sampler's distribution, and
stay unweighted.

- `token_truncate`: the term is multiplied by min(w, C) (TRL's `vllm_importance_sampling_mode=
  'token_truncate'`, verl's `rollout_is='token'`).
- `sequence_mask`: the trajectory's ratio is rho = exp(sum over its policy tokens of (logp_trainer -
  logp_sampler)), the product of its w (the sum, as TRL's sequence modes and verl's `'sequence'` level take
  it, not verl's `'geometric'` mean). A trajectory with rho > C or rho < 1/C has its policy-gradient terms
  multiplied by 0, every other one by 1: verl's sequence-level rejection sampling (`rollout_rs='sequence'`)
  with its default lower bound, the reciprocal of the upper. The denominator of the aggregation stays as it
  was, as TRL keeps its completion mask: each term's coefficient comes from the manifest before any logprob
  is known (docs/design.md, invariant 2), so a masked trajectory lowers the loss's scale instead of
  renormalizing the others.

The weights come from the scoring pass, so they need `ratio_source='scoring'`; `LossConfig` refuses a
correction without it. A policy token in a shared tree node has one weight per trajectory through it (each
trajectory has its own sampler logprob there), exactly as in the per-trajectory run.

Example:
    >>> import torch
    >>> from treetrain.loss.loss_config import LossConfig
    >>> trainer, sampler = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, float("nan")])
    >>> gap = SamplerGap.of(trainer, sampler)
    >>> gap.tokens, gap.mean, gap.max
    (2, 0.75, 1.0)
    >>> cfg = LossConfig(sampler_correction="token_truncate", sampler_correction_cap=1.5)
    >>> [round(w, 4) for w in token_weights(cfg, trainer[:2], sampler[:2]).tolist()]  # min(e^0.5, 1.5), e^-1
    [1.5, 0.3679]
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treetrain.loss.loss_config import LossConfig
from treetrain.loss.targets import TargetTable


@dataclass(frozen=True)
class SamplerGap:
    """Sum, count and largest |logp_trainer - logp_sampler| over policy tokens (tokens without a sampler
    logprob left out), how many of those tokens the correction changed, and the same three per weight
    version that sampled the tokens (`by_version`: (version, sum, count, largest), version ascending; tokens
    of unknown version left out). Sums, so that parts of an update and ranks combine exactly (`merged`)."""

    total: float = 0.0
    tokens: int = 0
    largest: float = 0.0
    corrected: int = 0
    """Tokens whose weight the correction set apart from w: truncated to the cap (`token_truncate`), or in a
    trajectory it dropped (`sequence_mask`)."""
    by_version: tuple[tuple[int, float, int, float], ...] = ()

    @staticmethod
    def of(trainer: torch.Tensor, sampler: torch.Tensor, version: torch.Tensor | None = None) -> SamplerGap:
        """The gap over `[C]` contributions; `sampler` is NaN where the sampler recorded no logprob, and
        `version` `[C]` (-1 unknown) the weight version that sampled each."""
        known = ~torch.isnan(sampler)
        gap = (trainer.detach().double() - sampler.double())[known].abs()  # [C_known]
        if gap.numel() == 0:
            return SamplerGap()
        parts: list[tuple[int, float, int, float]] = []
        if version is not None:
            versions = version.to(gap.device)[known]  # [C_known]
            for v in torch.unique(versions[versions >= 0]).tolist():
                part = gap[versions == v]
                parts.append((int(v), float(part.sum()), int(part.numel()), float(part.max())))
        return SamplerGap(float(gap.sum()), int(gap.numel()), float(gap.max()), by_version=tuple(parts))

    def merged(self, other: SamplerGap) -> SamplerGap:
        parts = {v: (t, n, m) for v, t, n, m in self.by_version}
        for v, t, n, m in other.by_version:
            if v in parts:
                t0, n0, m0 = parts[v]
                parts[v] = (t0 + t, n0 + n, max(m0, m))
            else:
                parts[v] = (t, n, m)
        return SamplerGap(
            self.total + other.total,
            self.tokens + other.tokens,
            max(self.largest, other.largest),
            self.corrected + other.corrected,
            tuple((v, *parts[v]) for v in sorted(parts)),
        )

    def by_lag(self, version: int) -> tuple[tuple[int, float, float, int], ...]:
        """(lag, mean gap, largest gap, tokens) per version lag at trainer version `version`, lag ascending.

        >>> SamplerGap(3.0, 3, 2.0, by_version=((4, 2.0, 1, 2.0), (5, 1.0, 2, 0.5))).by_lag(5)
        ((0, 0.5, 0.5, 2), (1, 2.0, 2.0, 1))
        """
        return tuple(sorted((version - v, t / n, m, n) for v, t, n, m in self.by_version if n))

    @property
    def mean(self) -> float | None:
        """Mean gap per token; None when no token had a sampler logprob (or none was scored)."""
        return self.total / self.tokens if self.tokens else None

    @property
    def max(self) -> float | None:
        """Largest gap; None when no token had a sampler logprob (or none was scored)."""
        return self.largest if self.tokens else None

    @property
    def corrected_fraction(self) -> float | None:
        """Fraction of the tokens whose weight the correction changed; None without tokens."""
        return self.corrected / self.tokens if self.tokens else None

    def encode(self) -> str:
        """Text for a cross-rank gather (`decode` reads it back)."""
        return json.dumps([self.total, self.tokens, self.largest, self.corrected, self.by_version])

    @staticmethod
    def decode(text: str) -> SamplerGap:
        total, tokens, largest, corrected, parts = json.loads(text)
        by_version = tuple((int(v), float(t), int(n), float(m)) for v, t, n, m in parts)
        return SamplerGap(float(total), int(tokens), float(largest), int(corrected), by_version)


def require_sampler_logprobs(sampler: torch.Tensor, cfg: LossConfig) -> None:
    """Refuse a correction over tokens the sampler recorded no logprob for (trees imported without them)."""
    if bool(torch.isnan(sampler).any()):
        raise ValueError(
            f"loss.sampler_correction is {cfg.sampler_correction!r} but some policy tokens have no sampler "
            "logprobs; record them at rollout or use sampler_correction='none'"
        )


def token_weights(cfg: LossConfig, trainer: torch.Tensor, sampler: torch.Tensor) -> torch.Tensor:
    """`token_truncate`'s weight of each of `[C]` contributions: min(exp(trainer - sampler), cap), detached."""
    require_sampler_logprobs(sampler, cfg)
    w = torch.exp(trainer.detach().double() - sampler.double())  # [C]
    return w.clamp(max=cfg.sampler_correction_cap)


def sequence_log_ratios(
    sequence: torch.Tensor, trainer: torch.Tensor, sampler: torch.Tensor, sequences: int
) -> torch.Tensor:
    """log rho of each of `sequences` trajectories: the sum of trainer - sampler over its contributions.

    `sequence` `[C]` (long) says which trajectory each contribution belongs to; returns `[sequences]` float64.
    """
    diff = trainer.detach().double() - sampler.double()  # [C]
    out = torch.zeros(sequences, dtype=torch.float64, device=diff.device)
    return out.index_add_(0, sequence.to(diff.device), diff)


def sequence_kept(cfg: LossConfig, log_ratio: torch.Tensor) -> torch.Tensor:
    """`sequence_mask`'s verdict per trajectory: rho within [1/cap, cap] (compared as logs, which cannot
    overflow however long the trajectory). A NaN log ratio (a missing sampler logprob) is never kept."""
    bound = math.log(cfg.sampler_correction_cap)
    return log_ratio.abs() <= bound  # [S] bool


def correction_weights(
    cfg: LossConfig,
    trainer: torch.Tensor,  # [C] the scoring pass's old logprobs
    sampler: torch.Tensor,  # [C]
    kept: torch.Tensor | None = None,  # [C] bool: the contribution's trajectory passed sequence_mask
) -> torch.Tensor | None:
    """The weight of each contribution's policy-gradient term (None: no correction). `kept` is needed, and
    only read, under `sequence_mask`; the engines compute it once per tree or update with `sequence_kept`."""
    if cfg.sampler_correction == "none":
        return None
    if cfg.sampler_correction == "token_truncate":
        return token_weights(cfg, trainer, sampler)
    require_sampler_logprobs(sampler, cfg)
    if kept is None:
        raise ValueError("sampler_correction='sequence_mask' needs each trajectory's verdict")
    return kept.to(torch.float64)


@dataclass(frozen=True)
class SamplerTerms:
    """What the scoring pass yields for the sampler: the gap, and `sequence_mask`'s verdicts."""

    gap: SamplerGap
    kept: torch.Tensor | None  # [S] bool
    """Per trajectory (the `sequence` ids of `sampler_terms`), whether it is kept; None unless
    `sequence_mask`."""


def sampler_terms(
    cfg: LossConfig,
    tables: Sequence[TargetTable],
    old: Sequence[torch.Tensor],  # [M_i] the scoring pass's logprob of each of table i's targets
    sequence: Sequence[torch.Tensor],  # [C_i] long: the trajectory of each of table i's contributions
    sequences: int,
) -> SamplerTerms:
    """The gap over the tables' contributions and, under `sequence_mask`, each trajectory's verdict. The
    tables must hold every contribution of the trajectories they name (a ratio is over all its tokens).

    The tree engine passes one table per unit of a tree (ids: trajectory indices), the flat reference one per
    call of the batch (ids: its trajectories, numbered)."""
    if not tables:  # nothing scored: no gap, and no trajectory has a token to weigh
        none = torch.zeros(sequences, dtype=torch.bool)
        return SamplerTerms(SamplerGap(), none if cfg.sampler_correction == "sequence_mask" else None)
    trainer = torch.cat(
        [lp.double()[torch.as_tensor(t.contrib_target, device=lp.device)] for t, lp in zip(tables, old)]
    )  # [C]
    sampler = torch.cat(
        [
            torch.as_tensor(t.sampler_logprob, dtype=torch.float64, device=lp.device)
            for t, lp in zip(tables, old)
        ]
    )  # [C]
    versions = None
    if all(t.sampler_version is not None for t in tables):
        versions = torch.cat([torch.as_tensor(t.sampler_version, dtype=torch.long) for t in tables])  # [C]
    gap = SamplerGap.of(trainer, sampler, versions)
    if cfg.sampler_correction == "none":
        return SamplerTerms(gap, None)
    require_sampler_logprobs(sampler, cfg)
    if cfg.sampler_correction == "token_truncate":
        over = trainer - sampler > math.log(cfg.sampler_correction_cap)  # [C]: w > cap
        return SamplerTerms(dataclasses.replace(gap, corrected=int(over.sum())), None)
    ids = torch.cat(list(sequence)).to(trainer.device)  # [C]
    kept = sequence_kept(cfg, sequence_log_ratios(ids, trainer, sampler, sequences))  # [S]
    return SamplerTerms(dataclasses.replace(gap, corrected=int((~kept[ids]).sum())), kept)
