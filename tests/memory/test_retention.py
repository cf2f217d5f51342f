"""Bounded retention changes cost, never the gradient; eviction is farthest-next-use; kept graphs are exact.

Gradients are compared with unbounded retention and with the flat reference, at 5 x the measured noise
floor of the flat path (as in test_replay_exact.py). Budgets from the minimum upwards force recomputes;
the tracker confirms resident bytes never exceed the budget.
"""

from __future__ import annotations

import itertools
import random
from functools import cache

import pytest
import torch
from support.replay_cases import SHAPES, factory, make_batch

from treetrain.bytesize import format_bytes
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.replay_layout import lay_out
from treetrain.memory.retention import BudgetTooSmallError, ResidentUse, plan_retention
from treetrain.memory.tracker import MemoryTracker
from treetrain.replay import ReplayConfig, TreeReplay
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor

FACTOR = 5.0


def keep_all(units):
    return frozenset(u.index for u in units.units[1:] if u.children)


def run(make, batch, loss, replay, budget=None, keep=None):
    model = make()
    model.zero_grad(set_to_none=True)
    tracker = MemoryTracker()
    layout = lay_out(batch, model, loss, replay, retention=budget, keep_graph=keep)
    report = TreeReplay(model, loss, replay, hooks=ReplayHooks(tracker=tracker)).accumulate(
        batch, layout.schedule
    )
    tracker.detach()
    return flat_grad(model), report, layout, tracker


@pytest.mark.parametrize("contract", ["exact", "response_only"])
def test_gradient_unchanged_under_every_feasible_budget(contract: str) -> None:
    loss = LossConfig()
    make = factory("llama", torch.float64)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    replay = ReplayConfig(contract=contract, microbatch=1, chunk_size=3)
    free, free_report, free_policy, _ = run(make, batch, loss, replay)
    assert free_report.recomputed_units == 0
    floor = noise_floor(make, batch, loss)
    flat = flat_gradient(make(), batch, loss)
    minimum = max(p.minimum for p in free_policy.retention)
    resident = max(p.peak for p in free_policy.retention)
    assert minimum < resident, "the case leaves nothing to evict"
    recomputes = []
    for budget in (minimum, (3 * minimum + resident) // 4, (minimum + 3 * resident) // 4):
        grad, report, policy, tracker = run(make, batch, loss, replay, budget)
        assert deviation(grad, free).abs <= FACTOR * floor, f"budget {budget}: gradient moved"
        if contract == "exact":
            assert deviation(grad, flat).abs <= FACTOR * floor
        assert tracker.class_maxima.prompt_group <= budget, "resident bytes exceeded the budget"
        assert report.recomputed_units == sum(p.recomputes for p in policy.retention)
        recomputes.append(report.recomputed_units)
    assert recomputes[0] >= 2, "the smallest budget should force several recomputes"
    assert recomputes == sorted(recomputes, reverse=True)


def test_budget_below_minimum_fails_cleanly_naming_it() -> None:
    loss = LossConfig()
    make = factory("llama", torch.float64)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    replay = ReplayConfig(microbatch=1, chunk_size=3)
    _, _, policy, _ = run(make, batch, loss, replay)
    minimum = policy.retention[0].minimum
    model = make()
    model.zero_grad(set_to_none=True)
    with pytest.raises(BudgetTooSmallError) as info:
        layout = lay_out(batch, model, loss, replay, retention=minimum - 1)
        TreeReplay(model, loss, replay).accumulate(batch, layout.schedule)
    assert info.value.minimum == minimum
    assert f"{minimum} B" in str(info.value) and format_bytes(minimum) in str(info.value)
    assert all(p.grad is None for p in model.parameters()), (
        "a refused budget must not leave partial gradients"
    )
    with pytest.raises(ValueError, match=">= 0"):
        lay_out(batch, model, loss, replay, retention=-1)


def test_host_tier_restores_instead_of_recomputing() -> None:
    """On a GPU the tier moves evicted KV to pinned host memory; on CPU the mechanics are the same."""
    loss = LossConfig()
    make = factory("llama", torch.float32)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    replay = ReplayConfig(microbatch=1, chunk_size=3)
    free, _, policy, _ = run(make, batch, loss, replay)
    budget = policy.retention[0].minimum
    _, recomputed, _, _ = run(make, batch, loss, replay, budget)
    model = make()
    model.zero_grad(set_to_none=True)
    tier = lay_out(batch, model, loss, replay, retention=budget, host_tier=True)
    report = TreeReplay(model, loss, replay).accumulate(batch, tier.schedule)
    assert report.restored_units == tier.retention[0].recomputes > 0
    assert report.recomputed_units == 0
    assert report.graph_tokens == recomputed.graph_tokens
    assert report.token_cost < recomputed.token_cost
    assert deviation(flat_grad(model), free).abs <= FACTOR * noise_floor(make, batch, loss)


# ----- eviction order ----------------------------------------------------------------------------------------
def test_eviction_follows_farthest_next_use_on_a_hand_built_schedule() -> None:
    uses = [ResidentUse(f"u{i}", need=need) for i, need in enumerate([(1,), (2,), (3,), (2,), (1,), (3,)])]
    plan = plan_retention(uses, kv_bytes=[0, 1, 1, 1], budget=2)
    # Before use 2, unit 1 (next needed at 4) goes rather than unit 2 (needed at 3). Before use 4, unit 3
    # (needed at 5) is kept over unit 2 (never needed again).
    assert plan.evict == ((), (), (1,), (), (2,), ())
    assert plan.compute == ((1,), (2,), (3,), (), (1,), ())
    assert plan.recomputes == 1 and plan.minimum == 1


def _optimal_misses(uses: list[tuple[int, ...]], capacity: int) -> int:
    """Fewest KV computations any eviction policy achieves (unit sizes), by exhaustive search."""

    @cache
    def best(i: int, resident: frozenset[int]) -> int:
        if i == len(uses):
            return 0
        need = frozenset(uses[i])
        others = sorted(resident - need)
        excess = len(resident | need) - capacity
        choices = itertools.combinations(others, excess) if excess > 0 else [()]
        return min(len(need - resident) + best(i + 1, (resident - set(v)) | need) for v in choices)

    return best(0, frozenset())


def _lru_misses(uses: list[tuple[int, ...]], capacity: int) -> int:
    resident: dict[int, int] = {}
    misses = 0
    for i, need in enumerate(uses):
        while len(set(resident) | set(need)) > capacity:
            victim = min((u for u in resident if u not in need), key=lambda u: resident[u])
            del resident[victim]
        misses += sum(1 for u in need if u not in resident)
        resident.update(dict.fromkeys(need, i))
    return misses


def test_eviction_is_optimal_on_random_schedules() -> None:
    rng = random.Random(0)
    for _ in range(40):
        units = rng.randint(3, 6)
        capacity = rng.randint(2, units - 1)
        uses = [
            tuple(rng.sample(range(1, units + 1), rng.randint(1, min(2, capacity))))
            for _ in range(rng.randint(4, 10))
        ]
        plan = plan_retention(
            [ResidentUse(str(i), need=n) for i, n in enumerate(uses)], [1] * (units + 1), capacity
        )
        assert sum(len(c) for c in plan.compute) == _optimal_misses(uses, capacity), uses


def test_negative_control_lru_is_not_optimal() -> None:
    """The optimality check can fail: least-recently-used eviction does worse on a cyclic schedule."""
    uses = [(1,), (2,), (3,), (1,), (2,), (3,), (1,), (2,), (3,)]
    assert _lru_misses(uses, 2) > _optimal_misses(uses, 2)
    plan = plan_retention([ResidentUse(str(i), need=n) for i, n in enumerate(uses)], [1] * 4, 2)
    assert sum(len(c) for c in plan.compute) == _optimal_misses(uses, 2)


# ----- kept graphs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "loss", [LossConfig(), LossConfig(ratio_source="sampler", kl_coef=0.05)], ids=["scoring", "sampler+kl"]
)
def test_kept_graphs_give_the_same_gradient_for_less_compute(loss: LossConfig) -> None:
    make = factory("llama", torch.float64)
    make_ref = factory("llama", torch.float64, seed=7) if loss.needs_reference else None
    batch = make_batch(SHAPES["two_trees"](0), loss)
    replay = ReplayConfig(microbatch=2, chunk_size=4)
    floor = noise_floor(make, batch, loss, make_ref)
    flat = flat_gradient(make(), batch, loss, make_ref() if make_ref else None)

    def tree(keep):
        model = make()
        model.zero_grad(set_to_none=True)
        ref = make_ref() if make_ref else None
        schedule = lay_out(batch, model, loss, replay, keep_graph=keep, ref_model=ref).schedule
        report = TreeReplay(model, loss, replay, ref_model=ref).accumulate(batch, schedule)
        return flat_grad(model), report

    recompute, r_report = tree(None)
    kept, k_report = tree(keep_all)
    assert k_report.kept_graphs > 0 and r_report.kept_graphs == 0
    assert deviation(kept, recompute).abs <= FACTOR * floor
    assert deviation(kept, flat).abs <= FACTOR * floor
    assert k_report.graph_tokens == r_report.graph_tokens
    assert k_report.token_cost < r_report.token_cost


def test_kept_graphs_save_exactly_their_no_grad_forward() -> None:
    loss = LossConfig()
    make = factory("llama", torch.float32)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    replay = ReplayConfig(microbatch=1)
    _, none, _, _ = run(make, batch, loss, replay)
    _, kept, _, _ = run(make, batch, loss, replay, keep=keep_all)
    from treetrain.replay.units import UnitTree

    work = batch.work[0]
    units = UnitTree.build(work.tree, work.targets)
    saved = sum(len(units[u].input_tokens) for u in keep_all(units))
    assert kept.kept_graphs == len(keep_all(units))
    assert none.token_cost - kept.token_cost == saved


def test_kept_graphs_under_a_budget_keep_the_gradient() -> None:
    loss = LossConfig()
    make = factory("llama", torch.float64)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    replay = ReplayConfig(microbatch=1, chunk_size=3)
    free, _, policy, _ = run(make, batch, loss, replay, keep=keep_all)
    grad, report, _, _ = run(make, batch, loss, replay, budget=policy.retention[0].minimum, keep=keep_all)
    assert report.recomputed_units > 0 and report.kept_graphs > 0
    assert deviation(grad, free).abs <= FACTOR * noise_floor(make, batch, loss)
