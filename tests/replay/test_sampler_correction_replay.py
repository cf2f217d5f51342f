"""The sampler correction and the sampler gap in the engines: tree replay (`exact`) equals the flat reference
with every correction mode, within the flat path's own noise floor (as in test_replay_exact.py); the
correction is what it says (the cap truncates, `sequence_mask` drops exactly the trajectories outside the
cap, with the denominator unchanged); and the logged gap is the hand computation.

The sampler logprobs are the trainer's own plus N(0, SIGMA) noise (tests/support/sampler_cases.py), so the
weights w = exp(trainer - sampler) spread around 1 and the cap matters for some tokens and trajectories.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support.replay_cases import SHAPES, factory, make_batch
from support.sampler_cases import resampled, trainer_logprobs, with_sampler_logprob, without_sampler_logprobs

from treetrain.loss.loss_config import LossConfig
from treetrain.loss.sampler_correction import SamplerGap
from treetrain.memory.replay_layout import lay_out
from treetrain.replay import FlatReference, ReplayConfig, TreeReplay, UpdateBatch
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor
from treetrain.trajectory import Role
from treetrain.tree import SamplingRecord, TrajectoryTree

FACTOR = 5.0
SIGMA = 0.4
make = factory("llama", torch.float64)
TRUNCATE = LossConfig(sampler_correction="token_truncate", sampler_correction_cap=1.5)
MASK = LossConfig(sampler_correction="sequence_mask", sampler_correction_cap=4.0)


@pytest.fixture(scope="module")
def trees() -> list[TrajectoryTree]:
    return resampled(SHAPES["two_trees"](0), make(), SIGMA, seed=3)


def _hand(trees: list[TrajectoryTree]) -> list[tuple[str, int, list[tuple[float, float]]]]:
    """Per trajectory: (tree id, index, [(trainer, sampler) of each policy token that carries loss]), from
    a plain forward of each (single-call) trajectory."""
    model = make()
    out = []
    for tree in trees:
        for i in range(len(tree.records)):
            traj = tree.trajectory(i)
            (call,) = traj.calls
            lps = trainer_logprobs(model, call.tokens)
            sampler = [x for seg in call.segments if seg.logprobs is not None for x in seg.logprobs]
            policy = [t for t, r in enumerate(call.roles) if r is Role.POLICY]
            assert len(policy) == len(sampler) and policy[0] > 0  # every policy token is a target
            out.append((tree.id, i, [(lps[t], s) for t, s in zip(policy, sampler)]))
    return out


def _tree_grad(batch: UpdateBatch, loss: LossConfig, plan: tuple[ReplayConfig, Any]) -> torch.Tensor:
    model = make()
    config, keep = plan
    schedule = lay_out(batch, model, loss, config, keep_graph=keep).schedule
    TreeReplay(model, loss, config).accumulate(batch, schedule)
    return flat_grad(model)


def _keep_all(units):  # every internal unit keeps its first graph
    return frozenset(u.index for u in units.units if u.children)


PLANS: dict[str, tuple[ReplayConfig, Any]] = {
    "K2": (ReplayConfig(microbatch=2), None),
    "K1-chunk3-reverse": (
        ReplayConfig(microbatch=1, chunk_size=3, order="reverse", score_microbatch=1),
        None,
    ),
    "K0-shuffle-kept-graphs": (ReplayConfig(order="shuffle", seed=5), _keep_all),
}
"""Name -> (replay config, kept graphs)."""


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize(
    "loss", [LossConfig(), TRUNCATE, MASK], ids=["none", "token_truncate", "sequence_mask"]
)
def test_exact_matches_flat_with_every_correction(trees, loss: LossConfig, plan: str) -> None:
    batch = make_batch(trees, loss)
    floor = noise_floor(make, batch, loss)
    flat = flat_gradient(make(), batch, loss)
    tree = _tree_grad(batch, loss, PLANS[plan])
    assert float(flat.norm()) > 0
    dev = deviation(tree, flat)
    assert dev.abs <= FACTOR * floor, (
        f"{loss.sampler_correction}/{plan}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"
    )
    if loss.corrects_sampler:  # the correction changes this case's gradient, far beyond the floor
        plain = flat_gradient(make(), batch, LossConfig())
        assert float((plain - flat).norm()) > 100 * FACTOR * floor


def test_the_case_has_weights_over_the_cap_and_trajectories_either_side_of_it(trees) -> None:
    """What makes the comparisons above bite: some token weights are truncated, and `sequence_mask` keeps
    some trajectories and drops others."""
    per_traj = _hand(trees)
    w = [math.exp(t - s) for _, _, pairs in per_traj for t, s in pairs]
    capped = sum(x > TRUNCATE.sampler_correction_cap for x in w)
    assert 0 < capped < len(w) // 2
    bound = math.log(MASK.sampler_correction_cap)
    dropped = sum(abs(sum(t - s for t, s in pairs)) > bound for _, _, pairs in per_traj)
    assert 0 < dropped < len(per_traj)
    # the counts the trainer logs (`sampler_corrected_fraction`), in both engines
    masked = sum(len(pairs) for _, _, pairs in per_traj if abs(sum(t - s for t, s in pairs)) > bound)
    for loss, expected in ((TRUNCATE, capped), (MASK, masked), (LossConfig(), 0)):
        batch = make_batch(trees, loss)
        tree = TreeReplay(make(), loss, ReplayConfig(microbatch=2)).accumulate(batch).sampler_gap
        flat = FlatReference(make(), loss, ReplayConfig(microbatch=2)).accumulate(batch).sampler_gap
        assert tree.corrected == flat.corrected == expected, loss.sampler_correction


def test_negative_control_a_perturbed_sampler_logprob_moves_the_gradient_only_under_a_correction(
    trees,
) -> None:
    tree = trees[0]
    ((_, _, pairs), *_) = _hand([tree])
    moved = [with_sampler_logprob(tree, 0, 3, min(0.0, pairs[3][0] + 0.5)), *trees[1:]]  # w: e^-0.5
    for loss, changes in ((LossConfig(), False), (TRUNCATE, True)):
        before, after = make_batch(trees, loss), make_batch(moved, loss)
        g0, g1 = flat_gradient(make(), before, loss), flat_gradient(make(), after, loss)
        if not changes:  # the ratio uses the scoring pass: the sampler's logprob is not read at all
            assert torch.equal(g0, g1)
            continue
        floor = noise_floor(make, before, loss)
        assert float((g0 - g1).norm()) > 100 * FACTOR * floor
        tree_g1 = _tree_grad(
            after, loss, (ReplayConfig(microbatch=2), None)
        )  # the tree path sees the same change
        assert deviation(tree_g1, g1).abs <= FACTOR * floor


def test_a_weight_over_the_cap_counts_as_the_cap(trees) -> None:
    """A token with w = e^3 > cap contributes exactly as one with w = cap; with a cap above e^3 it does not."""
    tree = trees[0]
    ((_, _, pairs), *_) = _hand([tree])
    trainer = pairs[2][0]
    cap = TRUNCATE.sampler_correction_cap
    far = [with_sampler_logprob(tree, 1, 2, trainer - 3.0), *trees[1:]]  # w = e^3 = 20
    at_cap = [with_sampler_logprob(tree, 1, 2, trainer - math.log(cap)), *trees[1:]]  # w = cap
    g_far = flat_gradient(make(), make_batch(far, TRUNCATE), TRUNCATE)
    g_cap = flat_gradient(make(), make_batch(at_cap, TRUNCATE), TRUNCATE)
    floor = noise_floor(make, make_batch(far, TRUNCATE), TRUNCATE)
    assert float((g_far - g_cap).norm()) <= FACTOR * floor
    assert (
        deviation(_tree_grad(make_batch(far, TRUNCATE), TRUNCATE, (ReplayConfig(), None)), g_cap).abs
        <= FACTOR * floor
    )
    wide = LossConfig(sampler_correction="token_truncate", sampler_correction_cap=30.0)  # negative control
    g_far_wide = flat_gradient(make(), make_batch(far, wide), wide)
    g_cap_wide = flat_gradient(make(), make_batch(at_cap, wide), wide)
    assert float((g_far_wide - g_cap_wide).norm()) > 100 * FACTOR * floor


def test_sequence_mask_drops_exactly_the_trajectories_outside_the_cap(trees) -> None:
    """Equal to the uncorrected loss over the kept trajectories alone, with every coefficient (so the
    denominator) unchanged: `UpdateBatch.restricted` keeps the whole batch's normalization."""
    bound = math.log(MASK.sampler_correction_cap)
    kept: dict[str, list[int]] = {}
    for tree_id, i, pairs in _hand(trees):
        if abs(sum(t - s for t, s in pairs)) <= bound:
            kept.setdefault(tree_id, []).append(i)
    batch = make_batch(trees, MASK)
    plain = LossConfig()
    only_kept = make_batch(trees, plain).restricted(kept)
    expected = flat_gradient(make(), only_kept, plain)
    floor = noise_floor(make, only_kept, plain)
    assert deviation(flat_gradient(make(), batch, MASK), expected).abs <= FACTOR * floor
    assert (
        deviation(_tree_grad(batch, MASK, (ReplayConfig(microbatch=2), None)), expected).abs <= FACTOR * floor
    )
    renormalized = flat_gradient(
        make(), make_batch([*trees], plain), plain
    )  # negative control: nothing dropped
    assert float((renormalized - expected).norm()) > 100 * FACTOR * floor


def test_the_gap_is_the_hand_computation_in_tree_and_flat_mode(trees) -> None:
    gaps = [abs(t - s) for _, _, pairs in _hand(trees) for t, s in pairs]
    batch = make_batch(trees, LossConfig())
    tree = (
        TreeReplay(make(), LossConfig(), ReplayConfig(microbatch=1, chunk_size=4))
        .accumulate(batch)
        .sampler_gap
    )
    flat = FlatReference(make(), LossConfig(), ReplayConfig(microbatch=3)).accumulate(batch).sampler_gap
    for gap in (tree, flat):
        assert gap.tokens == len(gaps)
        assert gap.mean == pytest.approx(sum(gaps) / len(gaps), rel=1e-6)
        assert gap.max == pytest.approx(max(gaps), rel=1e-6)


def test_no_gap_without_sampler_logprobs_or_without_a_scoring_pass() -> None:
    recorded = SHAPES["one_level"](0)  # synthetic_group records sampler logprobs
    for trees, loss in (
        (without_sampler_logprobs(recorded), LossConfig()),
        (recorded, LossConfig(ratio_source="sampler")),
    ):
        batch = make_batch(trees, loss)
        for report in (
            TreeReplay(make(), loss, ReplayConfig()).accumulate(batch),
            FlatReference(make(), loss).accumulate(batch),
        ):
            assert report.sampler_gap.mean is None and report.sampler_gap.max is None
    batch = make_batch(recorded, LossConfig())  # negative control: the same tree with its logprobs has a gap
    assert TreeReplay(make(), LossConfig(), ReplayConfig()).accumulate(batch).sampler_gap.mean is not None


def test_a_correction_over_tokens_without_sampler_logprobs_is_refused() -> None:
    stripped = without_sampler_logprobs(SHAPES["one_level"](0))
    for loss in (TRUNCATE, MASK):
        batch = make_batch(stripped, loss)
        for engine in (TreeReplay(make(), loss, ReplayConfig()), FlatReference(make(), loss)):
            with pytest.raises(ValueError, match="no sampler logprobs"):
                engine.accumulate(batch)


def test_sequence_mask_scores_branches_that_would_be_skipped_as_inert(trees) -> None:
    """Tree advantages with two sibling leaves of equal reward: those leaves' advantages are 0, so without a
    correction the engine skips them (no gradient). Their tokens still count in their trajectories' sequence
    ratios, so `sequence_mask` scores them, and tree replay still equals flat."""
    import dataclasses

    from treetrain.loss.advantages import AdvantageConfig
    from treetrain.tree.build import build_tree

    tree = trees[0]
    trajs = [tree.trajectory(i) for i in range(len(tree.records))]
    trajs[1] = dataclasses.replace(trajs[1], reward=trajs[0].reward)  # t0, t1 share turn_a and obs_1
    equal = [build_tree(trajs), *trees[1:]]
    adv = AdvantageConfig(mode="tree", zero_variance="keep")
    plain_batch = make_batch(equal, LossConfig(), adv)
    plain = TreeReplay(make(), LossConfig(), ReplayConfig()).accumulate(plain_batch)
    assert plain.skipped_units > 0  # the case has inert branches, skipped without a correction
    assert plain.sampler_gap.tokens < sum(len(p) for _, _, p in _hand(equal))  # and not in the gap then
    batch = make_batch(equal, MASK, adv)
    model = make()
    masked = TreeReplay(model, MASK, ReplayConfig(microbatch=2)).accumulate(batch)
    assert masked.skipped_units == 0
    floor = noise_floor(make, batch, MASK)
    assert deviation(flat_grad(model), flat_gradient(make(), batch, MASK)).abs <= FACTOR * floor


# ----- at a sampling temperature ----------------------------------------------------------------------
# Rollouts sampled at temperature T record logprobs of softmax(logits / T); the loss scores at the same T
# (`LossConfig.temperature`), in the scoring pass, the replay, the flat reference and the KL reference.

T = 0.7
make_ref = factory("llama", torch.float64, seed=2)
HOT_LOSSES = {
    "none": LossConfig(temperature=T),
    "token_truncate": dataclasses.replace(TRUNCATE, temperature=T),
    "sequence_mask": dataclasses.replace(MASK, temperature=T),
    "kl_entropy_truncate": dataclasses.replace(TRUNCATE, temperature=T, kl_coef=0.1, entropy_coef=0.01),
}


@pytest.fixture(scope="module")
def hot_trees() -> list[TrajectoryTree]:
    """The two-tree case with sampler logprobs of the tempered distribution (plus noise, as above)."""
    return resampled(SHAPES["two_trees"](0), make(), SIGMA, seed=3, temperature=T)


@pytest.mark.parametrize("plan", ["K2", "K0-shuffle-kept-graphs"])
@pytest.mark.parametrize("name", list(HOT_LOSSES))
def test_exact_matches_flat_at_a_sampling_temperature(hot_trees, name: str, plan: str) -> None:
    loss = HOT_LOSSES[name]
    ref = make_ref() if loss.needs_reference else None
    batch = make_batch(hot_trees, loss)
    floor = noise_floor(make, batch, loss, make_ref if ref is not None else None)
    flat = flat_gradient(make(), batch, loss, ref)
    model = make()
    config, keep = PLANS[plan]
    schedule = lay_out(batch, model, loss, config, keep_graph=keep, ref_model=ref).schedule
    TreeReplay(model, loss, config, ref_model=ref).accumulate(batch, schedule)
    dev = deviation(flat_grad(model), flat)
    assert float(flat.norm()) > 0
    assert dev.abs <= FACTOR * floor, f"{name}/{plan}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"
    # negative control: the same loss scored at temperature 1 is another gradient, far beyond the floor
    cold = flat_gradient(make(), batch, dataclasses.replace(loss, temperature=1.0), ref)
    assert float((cold - flat).norm()) > 100 * FACTOR * floor


def test_the_gap_to_an_exact_tempered_sampler_is_rounding_only_when_scored_at_its_temperature() -> None:
    """Sampler logprobs that are exactly the model's at T (no noise): scored at T, both engines' gap is
    float64 rounding; scored at 1 (the negative control), it is the temperature's effect."""
    exact = resampled(SHAPES["two_trees"](0), make(), 0.0, temperature=T)
    for loss in (LossConfig(temperature=T), LossConfig()):
        batch = make_batch(exact, loss)
        for gap in (
            TreeReplay(make(), loss, ReplayConfig(microbatch=2)).accumulate(batch).sampler_gap,
            FlatReference(make(), loss, ReplayConfig(microbatch=2)).accumulate(batch).sampler_gap,
        ):
            assert gap.tokens > 50 and gap.mean is not None and gap.max is not None
            if loss.temperature == T:
                assert gap.max < 1e-12
            else:
                assert gap.mean > 1e-2, gap


def test_the_kl_reference_is_scored_at_the_policys_temperature(hot_trees) -> None:
    """A reference equal to the policy has KL 0 when both are scored at T, in every way the engines score
    one (a reference left at temperature 1 would not: the hand computation below): its own walk, the
    policy's walk (fresh LoRA adapters, so adapters off is the same model), and the flat reference."""
    from support.lora_cases import base_model

    from treetrain.models.lora import AdaptersOff, LoraSection, apply_lora

    loss = LossConfig(temperature=T, kl_coef=0.1)
    batch = make_batch(hot_trees, loss)
    lora = apply_lora(base_model("llama", torch.float64), LoraSection(r=2))
    runs = (
        (TreeReplay(make(), loss, ReplayConfig(microbatch=2), ref_model=make()), len(batch.work)),
        (TreeReplay(lora, loss, ReplayConfig(microbatch=2), ref_model=AdaptersOff(lora)), 0),
        (FlatReference(make(), loss, ReplayConfig(microbatch=2), ref_model=make()), 0),
    )
    for engine, walks in runs:
        report = engine.accumulate(batch)
        assert report.reference_walks == walks  # the separate walk, the fused walk, the flat pass
        assert abs(report.kl) < 1e-12
    model, log_ratios = make(), []  # negative control: policy at T against the reference at 1, per token
    for tree in hot_trees:
        for i in range(len(tree.records)):
            (call,) = tree.trajectory(i).calls
            hot, cold = trainer_logprobs(model, call.tokens, T), trainer_logprobs(model, call.tokens)
            log_ratios += [cold[t] - hot[t] for t, r in enumerate(call.roles) if r is Role.POLICY]
    k3 = [math.exp(d) - d - 1 for d in log_ratios]
    assert sum(k3) / len(k3) > 1e-4  # eight orders above the bound on the engines' KL


# ----- against the inference engines ------------------------------------------------------------------
# The gap as the trainer logs it: what an engine recorded while sampling at T, against the trainer's scoring
# pass over the trees it wrote, in float32 on the demo policy.

GAP_MEAN = 1e-6
GAP_MAX = 5e-5
"""Bounds on the mean and the largest per-token gap at T in float32: rounding, a KV-cached decode against a
batched forward (logprobs are above -6 here, where a float32 ulp is 5e-7). Measured with the `hf` engine:
mean 5.7e-7, max 1.0e-5 at T = 0.7, and mean 4.6e-7, max 6.7e-6 sampled and scored at 1, the same
arithmetic; the largest token is a few ulps of logits that went through every layer. vLLM's CPU build at
T = 0.7: mean 5.7e-7, max 6.7e-6. Scored at 1 instead, the mean is 3.4e-2 (hf) and 3.8e-2 (vLLM)."""


def _engine_gap(model_dir: Any, engine: Any, tmp_path: Path) -> tuple[SamplerGap, SamplerGap]:
    """Roll out calculator trees at T with `engine` (None: the `hf` engine over the model), then the gap of
    the scoring pass at T and, the negative control, at temperature 1."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from envs import EpisodeLimits, WrapperConfig, make_env
    from treetrain.rollout import FanOut, RolloutConfig, SamplerConfig, Sampling, rollout_trees

    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    wrapper = WrapperConfig(EpisodeLimits(max_turns=3, max_turn_tokens=32), stop_token_ids=(2,))
    config = RolloutConfig(FanOut(root=4), SamplerConfig(Sampling(temperature=T), seed=1), wrapper,
                           model_version=getattr(engine, "version", None))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(model_dir)
    if engine is None:
        from treetrain.rollout.engines.hf_engine import HFEngine

        engine = HFEngine(model)
    result = rollout_trees(model, tok, lambda: make_env("calculator"), [0, 1], tmp_path, config,
                           env_name="calculator", engine=engine)  # fmt: skip
    trees = list(result.trees)
    assert trees and all(t.sampling == SamplingRecord(T, 1.0) for t in trees)  # what the files say too
    gaps = []
    for loss in (LossConfig(temperature=T), LossConfig()):
        replay = ReplayConfig(skip_inert=False)  # every token scored, whatever its advantage
        gaps.append(TreeReplay(model, loss, replay).accumulate(make_batch(trees, loss)).sampler_gap)
    return gaps[0], gaps[1]


def _check(on: SamplerGap, off: SamplerGap, name: str) -> None:
    print(f"{name} at T={T}: gap mean {on.mean:.2e} max {on.max:.2e}; scored at 1: mean {off.mean:.2e}")
    assert on.tokens >= 40 and on.mean is not None and on.max is not None
    assert on.mean < GAP_MEAN and on.max < GAP_MAX
    assert off.mean is not None and off.mean > 1e4 * GAP_MEAN  # negative control: scored at 1


def test_the_hf_engines_logprobs_at_a_temperature_are_the_scoring_pass_at_it(tmp_path: Path) -> None:
    from treetrain.train.models import DEMO_MODEL

    _check(*_engine_gap(DEMO_MODEL, None, tmp_path), "hf")


def test_vllms_logprobs_at_a_temperature_are_the_scoring_pass_at_it(vllm_engine: Any, tmp_path: Path) -> None:
    """The session's real vLLM (`tests/conftest.py`), on the wide demo model it serves."""
    from treetrain.train.models import WIDE_DEMO_MODEL

    _check(*_engine_gap(WIDE_DEMO_MODEL, vllm_engine, tmp_path), "vllm")
