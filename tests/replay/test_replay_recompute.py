"""Recomputed resident state equals scored state: `exact` against the flat reference where units are
recomputed from their parent's resident state instead of scored, for every preset with recurrent layers
(hybrid layers included).

Two paths recompute a unit (`PathKV._recompute`):

- `ratio_source='sampler'`: no scoring pass, so every internal unit's state is produced the first time a
  step needs it, on deep trees (three levels) and multi-call trees (a second call that drops the first's
  reasoning);
- the smallest retention budget with every internal unit's graph kept: evicted state is recomputed, and
  a kept unit's graph is closed against it (KL to a separate reference and entropy, chunks of 5).

A recurrent layer's state is taken before a unit's last token, so a recompute feeds the parent's last token
again, as the children do. A model of hybrid layers only (Falcon-H1: attention and a Mamba-2 mixer in every
layer) has no layer without KV, and the negative controls recompute it without that overlap: the Mamba-2
state then skips one token, which the check catches far above the bound and the support probe refuses.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.replay_cases import SHAPES, factory, make_batch
from support.sampler_cases import resampled

from treetrain.loss.loss_config import LossConfig
from treetrain.memory.replay_layout import lay_out
from treetrain.models.presets import EAGER_ONLY, RECURRENT_FAMILIES
from treetrain.models.support import UnsupportedModelError, check_supported
from treetrain.replay import ReplayConfig, TreeReplay
from treetrain.replay.scoring import PathKV
from treetrain.replay.units import UnitTree
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor

FACTOR = 5.0
SAMPLER = LossConfig(
    ratio_source="sampler", kl_coef=0.05, kl_estimator="k1", aggregation="seq-mean-token-sum", clip_low=0.1
)
"""The sampler's logprobs as PPO's old ones, clipped, Dr. GRPO's aggregation and k1 KL."""
KEPT = LossConfig(kl_coef=0.05, entropy_coef=0.01)


def _keep_all(units: UnitTree) -> frozenset[int]:
    return frozenset(u.index for u in units.units if u.children)


def _sampler_case(family: str) -> tuple[Callable[[], torch.nn.Module], Callable[[], torch.nn.Module], object]:
    attn = "eager" if family in EAGER_ONLY else "sdpa"
    make, make_ref = factory(family, torch.float64, attn), factory(family, torch.float64, attn, seed=7)
    trees = resampled(SHAPES["multi_level"](0) + SHAPES["multi_call"](1), make(), 0.3, seed=3)
    return make, make_ref, make_batch(trees, SAMPLER)


def _sampler_deviation(family: str) -> tuple[float, float]:
    make, make_ref, batch = _sampler_case(family)
    floor = noise_floor(make, batch, SAMPLER, make_ref)
    flat = flat_gradient(make(), batch, SAMPLER, make_ref())
    model = make()
    model.zero_grad(set_to_none=True)
    report = TreeReplay(model, SAMPLER, ReplayConfig(microbatch=2), ref_model=make_ref()).accumulate(batch)
    assert report.recomputed_units > 0, "without a scoring pass internal units are recomputed"
    assert float(flat.norm()) > 0
    return deviation(flat_grad(model), flat).abs, floor


def _kept_deviation(family: str) -> tuple[float, float]:
    attn = "eager" if family in EAGER_ONLY else "sdpa"
    make, make_ref = factory(family, torch.float64, attn), factory(family, torch.float64, attn, seed=7)
    batch = make_batch(SHAPES["multi_level"](0), KEPT)
    replay = ReplayConfig(microbatch=1, chunk_size=5)
    model = make()
    free = lay_out(batch, model, KEPT, replay, keep_graph=_keep_all)
    minimum = max(p.minimum for p in free.retention)
    assert minimum < max(p.peak for p in free.retention), "the case leaves nothing to evict"
    laid = lay_out(batch, model, KEPT, replay, retention=minimum, keep_graph=_keep_all)
    assert any(s.kept for s in laid.schedule.trees), "the plan keeps no graph"
    model.zero_grad(set_to_none=True)
    report = TreeReplay(model, KEPT, replay, ref_model=make_ref()).accumulate(batch, laid.schedule)
    assert report.recomputed_units > 0, "the smallest budget should force recomputes"
    floor = noise_floor(make, batch, KEPT, make_ref)
    flat = flat_gradient(make(), batch, KEPT, make_ref())
    return deviation(flat_grad(model), flat).abs, floor


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_sampler_ratio_exact_on_deep_and_multi_call_trees(family: str) -> None:
    dev, floor = _sampler_deviation(family)
    assert dev <= FACTOR * floor, f"{family}: |tree - flat| = {dev:.3e} > {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_smallest_budget_with_kept_graphs_is_exact(family: str) -> None:
    dev, floor = _kept_deviation(family)
    assert dev <= FACTOR * floor, f"{family}: |tree - flat| = {dev:.3e} > {FACTOR} x {floor:.3e}"


def _without_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recompute a unit against its parent's whole path, as if no layer's state were taken before a unit's
    last token: right for KV, one token short for a Mamba-2 state."""
    init = PathKV.__init__

    def patched(self: PathKV, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        self.overlap = False

    monkeypatch.setattr(PathKV, "__init__", patched)


@pytest.mark.parametrize("case", ["sampler", "kept"])
def test_negative_control_recompute_without_the_overlap_is_caught(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    _without_overlap(monkeypatch)
    dev, floor = (_sampler_deviation if case == "sampler" else _kept_deviation)("falcon_h1")
    assert dev > 10 * FACTOR * floor, f"a recompute that skips a token went unnoticed: {dev:.3e}"


def test_negative_control_support_probe_refuses_a_recompute_without_the_overlap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe continues and recomputes spans with the engine's own rule (`treetrain.models.continuation`),
    so a family the engine would recompute wrongly is refused before it trains."""
    import treetrain.models.continuation as continuation

    model = factory("falcon_h1", torch.float64)()
    check_supported(model, 64)
    monkeypatch.setattr(continuation, "continues_with_overlap", lambda model: False)
    with pytest.raises(UnsupportedModelError, match=r"falcon_h1.*changes the hidden states"):
        check_supported(model, 64)
