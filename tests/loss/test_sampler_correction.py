"""The sampler correction's arithmetic (`treetrain.loss.sampler_correction`), its place in the objective, and
the one-line refusals of settings that make no sense."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from treetrain.errors import ConfigError
from treetrain.loss.loss_config import LossConfig
from treetrain.loss.objective import Contributions, objective
from treetrain.loss.sampler_correction import (
    SamplerGap,
    correction_weights,
    sampler_terms,
    sequence_kept,
    sequence_log_ratios,
    token_weights,
)
from treetrain.loss.targets import TargetTable

TRUNCATE = LossConfig(sampler_correction="token_truncate", sampler_correction_cap=2.0)
MASK = LossConfig(sampler_correction="sequence_mask", sampler_correction_cap=2.0)


def test_a_weight_over_the_cap_is_the_cap_and_one_under_it_is_itself() -> None:
    sampler = torch.tensor([-3.0, -1.0, -2.0], dtype=torch.float64)
    trainer = sampler + torch.tensor([math.log(5.0), math.log(1.5), math.log(0.25)], dtype=torch.float64)
    w = token_weights(TRUNCATE, trainer, sampler)
    assert w.tolist() == pytest.approx([2.0, 1.5, 0.25], abs=1e-12)  # w = 5 > cap: the cap
    assert token_weights(LossConfig(sampler_correction="token_truncate", sampler_correction_cap=6.0), trainer,
                         sampler)[0] == pytest.approx(5.0)  # fmt: skip


def test_the_weight_is_detached() -> None:
    trainer = torch.tensor([-1.0, -2.0], requires_grad=True)
    w = token_weights(TRUNCATE, trainer, torch.tensor([-1.2, -1.9]))
    assert not w.requires_grad


def test_sequence_ratio_sums_each_trajectorys_tokens_and_masks_outside_one_over_cap_to_cap() -> None:
    # three trajectories: log rho = 0.5 + 0.4 (rho 2.46 > 2), -0.3 - 0.5 (rho 0.45 < 1/2), 0.2 - 0.1 (kept)
    diff = torch.tensor([0.5, -0.3, 0.2, 0.4, -0.5, -0.1], dtype=torch.float64)
    sequence = torch.tensor([0, 1, 2, 0, 1, 2])
    sampler = torch.full((6,), -2.0, dtype=torch.float64)
    log_ratio = sequence_log_ratios(sequence, sampler + diff, sampler, 3)
    assert log_ratio.tolist() == pytest.approx([0.9, -0.8, 0.1])
    assert sequence_kept(MASK, log_ratio).tolist() == [False, False, True]
    # the bounds themselves are kept; a NaN (a missing sampler logprob) never is
    edge = torch.tensor([math.log(2.0) - 1e-12, -math.log(2.0) + 1e-12, math.nan], dtype=torch.float64)
    assert sequence_kept(MASK, edge).tolist() == [True, True, False]


def test_weights_per_mode() -> None:
    trainer, sampler = torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -3.0])
    assert correction_weights(LossConfig(), trainer, sampler) is None
    kept = torch.tensor([True, False])
    assert correction_weights(MASK, trainer, sampler, kept).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="needs each trajectory's verdict"):
        correction_weights(MASK, trainer, sampler)
    with pytest.raises(ValueError, match="no sampler logprobs"):
        correction_weights(TRUNCATE, trainer, torch.tensor([-1.0, math.nan]))


def _contrib() -> Contributions:
    return Contributions(
        target=torch.tensor([0, 1, 1]),
        coef=torch.full((3,), 1 / 3),
        advantage=torch.tensor([1.0, -1.0, 0.5]),
        old_logprob=torch.tensor([-1.0, -2.0, -2.0]),
    )


def test_the_weight_multiplies_the_policy_gradient_term_only() -> None:
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.05)
    logp = torch.tensor([-1.1, -1.8], requires_grad=True)
    ref, ent = torch.tensor([-1.0, -2.2]), torch.tensor([1.5, 0.7])
    plain = objective(cfg, logp, _contrib(), entropy=ent, ref_logprob=ref)
    zero = objective(cfg, logp, _contrib(), entropy=ent, ref_logprob=ref, pg_weight=torch.zeros(3))
    assert plain.pg != 0 and zero.pg == 0.0
    assert zero.kl == plain.kl and zero.entropy == plain.entropy  # KL and entropy unweighted
    assert float(zero.loss.detach()) == pytest.approx(float(plain.loss.detach()) - plain.pg)
    w = torch.tensor([2.0, 0.5, 1.0])
    weighted = objective(cfg, logp, _contrib(), entropy=ent, ref_logprob=ref, pg_weight=w)
    c = _contrib()
    alone = [  # each contribution's own policy-gradient term
        objective(LossConfig(), logp, Contributions(c.target[i : i + 1], c.coef[i : i + 1],
                  c.advantage[i : i + 1], c.old_logprob[i : i + 1])).pg
        for i in range(3)
    ]  # fmt: skip
    assert weighted.pg == pytest.approx(sum(float(w[i]) * alone[i] for i in range(3)))
    assert weighted.pg != pytest.approx(sum(alone))  # negative control: these weights do change the sum
    ones = objective(cfg, logp, _contrib(), entropy=ent, ref_logprob=ref, pg_weight=torch.ones(3))
    assert float(ones.loss.detach()) == float(plain.loss.detach())


def test_gap_sums_merge_exactly_and_are_none_without_tokens() -> None:
    gap = SamplerGap.of(torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, math.nan]))
    assert (gap.tokens, gap.mean, gap.max) == (2, pytest.approx(0.75), pytest.approx(1.0))
    empty = SamplerGap.of(torch.tensor([-1.0]), torch.tensor([math.nan]))
    assert empty.mean is None and empty.max is None and empty.tokens == 0
    other = SamplerGap.of(torch.tensor([-3.0]), torch.tensor([-0.5]))
    both = gap.merged(other).merged(empty)
    assert (both.tokens, both.max) == (3, 2.5) and both.mean == pytest.approx((0.5 + 1.0 + 2.5) / 3)
    assert SamplerGap.decode(both.encode()) == both


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sampler_correction": "tis"}, "sampler_correction"),
        ({"sampler_correction_cap": 1.0}, "sampler_correction_cap"),
        ({"sampler_correction_cap": 0.5}, "sampler_correction_cap"),
        ({"sampler_correction_cap": math.inf}, "sampler_correction_cap"),
        ({"sampler_correction_cap": math.nan}, "sampler_correction_cap"),
        ({"sampler_correction": "token_truncate", "ratio_source": "sampler"}, "sampler_correction"),
        ({"sampler_correction": "sequence_mask", "ratio_source": "sampler"}, "sampler_correction"),
    ],
)
def test_settings_that_make_no_sense_are_one_line_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        LossConfig(**kwargs)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")
    assert "\n" not in str(info.value)


def test_negative_control_sensible_settings_are_accepted() -> None:
    for mode in ("none", "token_truncate", "sequence_mask"):
        assert LossConfig(sampler_correction=mode, sampler_correction_cap=1.01).sampler_correction == mode
    assert LossConfig(ratio_source="sampler").sampler_correction == "none"


def _table(sampler: list[float], contrib_target: list[int], trajectory: list[int]) -> TargetTable:
    m = max(contrib_target) + 1
    return TargetTable(
        np.arange(m), np.arange(m), np.asarray(contrib_target), np.full(len(sampler), 0.5), np.ones(len(sampler)),
        np.asarray(sampler), np.asarray(trajectory),
    )  # fmt: skip


def test_sampler_terms_gather_each_trajectorys_tokens_across_tables() -> None:
    # table a: targets 0, 1; target 1 shared by trajectories 0 and 1 (one trainer logprob, two sampler ones)
    a = _table([-1.0, -2.0, -2.5], [0, 1, 1], [0, 0, 1])
    b = _table([-0.5], [0], [1])  # trajectory 1 again, in another table (a later unit or call)
    old = [torch.tensor([-1.4, -2.2]), torch.tensor([-2.0])]
    sequence = [torch.as_tensor(a.trajectory), torch.as_tensor(b.trajectory)]
    terms = sampler_terms(MASK, [a, b], old, sequence, 2)
    gaps = [0.4, 0.2, 0.3, 1.5]
    assert terms.gap.tokens == 4 and terms.gap.mean == pytest.approx(sum(gaps) / 4) and terms.gap.max == 1.5
    # log rho: trajectory 0: -0.4 - 0.2 = -0.6 (kept, > -log 2); trajectory 1: 0.3 - 1.5 = -1.2 (dropped)
    assert terms.kept is not None and terms.kept.tolist() == [True, False]
    assert terms.gap.corrected == 2  # trajectory 1's two tokens, masked
    assert sampler_terms(TRUNCATE, [a, b], old, sequence, 2).kept is None
    assert sampler_terms(TRUNCATE, [a, b], old, sequence, 2).gap.corrected == 0  # no w above 2
    tight = LossConfig(sampler_correction="token_truncate", sampler_correction_cap=1.2)  # log 1.2 = 0.18
    assert sampler_terms(tight, [a, b], old, sequence, 2).gap.corrected == 1  # only w = e^0.3 is over it
    assert sampler_terms(LossConfig(), [a, b], old, sequence, 2).gap.corrected == 0
    empty = sampler_terms(MASK, [], [], [], 3)
    assert empty.gap.mean is None and empty.kept is not None and empty.kept.tolist() == [False] * 3


def _flat(rows: tuple[tuple[float, ...], ...]) -> list[float]:
    return [x for row in rows for x in row]


def test_the_gap_splits_by_the_version_that_sampled_each_token_and_rejoins_exactly() -> None:
    a = _table([-1.0, -2.0, -2.5], [0, 1, 1], [0, 0, 1])
    a = TargetTable(*(getattr(a, f) for f in ("positions", "tokens", "contrib_target", "coef", "advantage")),
                    a.sampler_logprob, a.trajectory, np.asarray([3, 4, -1]))  # fmt: skip
    b = _table([-0.5], [0], [1])
    b = TargetTable(*(getattr(b, f) for f in ("positions", "tokens", "contrib_target", "coef", "advantage")),
                    b.sampler_logprob, b.trajectory, np.asarray([4]))  # fmt: skip
    old = [torch.tensor([-1.4, -2.2]), torch.tensor([-2.0])]
    sequence = [torch.as_tensor(a.trajectory), torch.as_tensor(b.trajectory)]
    gap = sampler_terms(LossConfig(), [a, b], old, sequence, 2).gap
    assert gap.tokens == 4  # the token of unknown version counts in the whole, not in a version
    assert _flat(gap.by_version) == pytest.approx([3, 0.4, 1, 0.4, 4, 0.2 + 1.5, 2, 1.5])
    assert _flat(gap.by_lag(5)) == pytest.approx([1, 0.85, 1.5, 2, 2, 0.4, 0.4, 1])
    assert SamplerGap.decode(gap.encode()) == gap
    halves = SamplerGap.of(torch.tensor([-1.4]), torch.tensor([-1.0]), torch.tensor([3])).merged(
        SamplerGap.of(torch.tensor([-2.2, -2.0]), torch.tensor([-2.0, -0.5]), torch.tensor([4, 4]))
    )
    assert _flat(halves.by_version) == pytest.approx(_flat(gap.by_version))  # parts combine exactly
    unknown = sampler_terms(LossConfig(), [_table([-1.0], [0], [0])], [torch.tensor([-1.4])], sequence[:1], 1)
    assert unknown.gap.tokens == 1 and unknown.gap.by_version == ()  # negative control: no versions, no split
