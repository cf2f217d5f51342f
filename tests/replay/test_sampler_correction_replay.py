"""The sampler correction and the sampler gap in the engines: tree replay (`exact`) equals the flat reference
with every correction mode, within the flat path's own noise floor (as in test_replay_exact.py); the
correction is what it says (the cap truncates, `sequence_mask` drops exactly the trajectories outside the
cap, with the denominator unchanged); and the logged gap is the hand computation.

The sampler logprobs are the trainer's own plus N(0, SIGMA) noise (tests/support/sampler_cases.py), so the
weights w = exp(trainer - sampler) spread around 1 and the cap matters for some tokens and trajectories.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.replay_cases import SHAPES, factory, make_batch
from support.sampler_cases import resampled, trainer_logprobs, with_sampler_logprob, without_sampler_logprobs

from treetrain.loss.loss_config import LossConfig
from treetrain.replay import FlatReference, ReplayConfig, ReplayPlan, TreeReplay, UpdateBatch
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor
from treetrain.trajectory import Role
from treetrain.tree import TrajectoryTree

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


def _tree_grad(batch: UpdateBatch, loss: LossConfig, plan: ReplayPlan | ReplayConfig) -> torch.Tensor:
    model = make()
    TreeReplay(model, loss, plan).accumulate(batch)
    return flat_grad(model)


def _keep_all(units):  # every internal unit keeps its first graph
    return frozenset(u.index for u in units.units if u.children)


PLANS = {
    "K2": ReplayConfig(microbatch=2),
    "K1-chunk3-reverse": ReplayConfig(microbatch=1, chunk_size=3, order="reverse", score_microbatch=1),
    "K0-shuffle-kept-graphs": ReplayPlan(config=ReplayConfig(order="shuffle", seed=5), keep_graph=_keep_all),
}


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
        tree_g1 = _tree_grad(after, loss, ReplayConfig(microbatch=2))  # the tree path sees the same change
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
        deviation(_tree_grad(make_batch(far, TRUNCATE), TRUNCATE, ReplayConfig()), g_cap).abs
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
    assert deviation(_tree_grad(batch, MASK, ReplayConfig(microbatch=2)), expected).abs <= FACTOR * floor
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
