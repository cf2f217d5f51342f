"""The per-token objective, shared verbatim by the flat reference and the tree engine.

A *target* is one predicted token (a logprob at one position). A *contribution* is one trajectory's share
of a target: its normalization coefficient, its advantage and its old logprob. A policy token inside a shared
node is one target with one contribution per trajectory through it, which is how the tree sums the
per-trajectory terms exactly.

Example:
    >>> import torch
    >>> from treetrain.loss.loss_config import LossConfig
    >>> logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    >>> c = Contributions(target=torch.tensor([0, 1, 1]), coef=torch.full((3,), 1 / 3),
    ...                   advantage=torch.tensor([1.0, -1.0, 0.5]), old_logprob=torch.tensor([-1.0, -2.0, -2.0]))
    >>> round(objective(LossConfig(), logp, c).loss.item(), 4)
    -0.1667
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treetrain.loss.loss_config import LossConfig


@dataclass(frozen=True)
class Contributions:
    """Per-contribution loss inputs, all `[C]`; `target` indexes the `[M]` target arrays."""

    target: torch.Tensor  # [C] long
    coef: torch.Tensor  # [C]
    advantage: torch.Tensor  # [C]
    old_logprob: torch.Tensor  # [C]

    def __len__(self) -> int:
        return int(self.target.shape[0])


@dataclass(frozen=True)
class LossTerms:
    """The scalar to backpropagate and detached, coefficient-weighted sums for logging."""

    loss: torch.Tensor
    pg: float
    kl: float
    entropy: float
    clipped: float
    """Coefficient-weighted fraction of contributions whose ratio was clipped."""


def sampler_logprobs(contrib: Contributions) -> torch.Tensor:
    """The contributions' sampler logprobs as old logprobs; refuses tokens the sampler gave none for."""
    if torch.isnan(contrib.old_logprob).any():
        raise ValueError(
            "loss.ratio_source is 'sampler' but some policy tokens have no sampler logprobs; "
            "record them at rollout or use ratio_source='scoring'"
        )
    return contrib.old_logprob


def kl_per_target(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return logp - ref
    delta = ref - logp
    return torch.exp(delta) - delta - 1.0


def objective(
    cfg: LossConfig,
    logp: torch.Tensor,  # [M] float32 (graph)
    contrib: Contributions,
    *,
    entropy: torch.Tensor | None = None,  # [M]
    ref_logprob: torch.Tensor | None = None,  # [M]
    pg_weight: torch.Tensor | None = None,  # [C] detached
) -> LossTerms:
    """The loss of `contrib`'s terms over targets `logp`.

    `pg_weight`, if given, multiplies each contribution's policy-gradient term, and only that term (the
    sampler correction, `treetrain.loss.sampler_correction`); the KL and entropy terms are never weighted.
    """
    dtype = logp.dtype
    coef = contrib.coef.to(dtype)
    adv = contrib.advantage.to(dtype)
    lp = logp[contrib.target]  # [C]
    ratio = torch.exp(lp - contrib.old_logprob.to(dtype))
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(-ratio * adv, -clipped_ratio * adv)
    if cfg.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.dual_clip), pg)
    if pg_weight is not None:
        pg = pg * pg_weight.detach().to(device=pg.device, dtype=dtype)
    loss = (coef * pg).sum()
    kl_sum = 0.0
    ent_sum = 0.0
    if cfg.kl_coef > 0:
        if ref_logprob is None:
            raise ValueError("kl_coef > 0 but no reference logprobs were computed")
        kl = kl_per_target(logp, ref_logprob.to(dtype), cfg.kl_estimator)[contrib.target]
        loss = loss + cfg.kl_coef * (coef * kl).sum()
        kl_sum = float((coef * kl).sum().detach())
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 but entropy was not computed")
        ent = entropy[contrib.target]
        loss = loss - cfg.entropy_coef * (coef * ent).sum()
        ent_sum = float((coef * ent).sum().detach())
    with torch.no_grad():
        was_clipped = (ratio != clipped_ratio).to(dtype)
        clip_frac = float((coef * was_clipped).sum())
    return LossTerms(loss, float((coef * pg).sum().detach()), kl_sum, ent_sum, clip_frac)
