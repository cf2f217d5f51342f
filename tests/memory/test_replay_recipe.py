"""The planner's per-rank plan is immutable and complete, and the replay engine carries it out as given.

Laid out under a retention budget with kept graphs, the plan names every tree of the batch and an eviction
entry for each scoring batch and step; replaying it evicts exactly what it lists and equals the flat
reference at 5 x the measured noise floor. Negative controls: a plan made for another K, for other trees,
keeping a leaf's graph, or missing an event is refused before any gradient accumulates.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest
import torch
from support.replay_cases import SHAPES, factory, make_batch
from treetrain.memory.replay_recipe import ReplayRecipe

from treetrain.loss.loss_config import LossConfig
from treetrain.replay import ReplayConfig, ReplayPlan, ReplayReport, TreeReplay, UpdateBatch
from treetrain.replay.replay_schedule import PlanMismatchError
from treetrain.replay.schedule import ReplayStep
from treetrain.replay.scoring import ScoreBatch
from treetrain.replay.units import UnitTree
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor

FACTOR = 5.0
LOSS = LossConfig()
REPLAY = ReplayConfig(microbatch=1, chunk_size=3)
MAKE = factory("llama", torch.float64)


def keep_all(units: UnitTree) -> frozenset[int]:
    return frozenset(u.index for u in units.units[1:] if u.children)


@pytest.fixture(scope="module")
def batch() -> UpdateBatch:
    return make_batch(SHAPES["multi_level"](0), LOSS)


def _replay(batch: UpdateBatch, plan: ReplayPlan) -> tuple[torch.Tensor, ReplayReport, torch.nn.Module]:
    model = MAKE()
    model.zero_grad(set_to_none=True)
    report = TreeReplay(model, LOSS, plan).accumulate(batch)
    return flat_grad(model), report, model


def test_the_plan_is_immutable_and_complete_and_the_engine_carries_it_out(batch: UpdateBatch) -> None:
    model = MAKE()
    free = ReplayRecipe(config=REPLAY, keep_graph=keep_all).lay_out(batch, model, LOSS)
    minimum = max(p.minimum for p in free.retention)
    layout = ReplayRecipe(config=REPLAY, retention=minimum, keep_graph=keep_all).lay_out(batch, model, LOSS)
    plan = layout.plan
    assert plan.trees is not None
    assert [s.tree_id for s in plan.trees] == [w.tree.id for w in batch.work]
    for schedule, tree in zip(plan.trees, layout.trees):
        listed = [
            (use.event, evicted)
            for use, evicted in zip(tree.uses, tree.plan.evict)
            if isinstance(use.event, (ScoreBatch, ReplayStep))
        ]
        assert [(e.before, e.units) for e in schedule.evictions] == listed
        assert schedule.steps == tree.steps and schedule.kept == keep_all(tree.units)
    with pytest.raises(FrozenInstanceError):
        plan.trees = ()  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        plan.trees[0].evictions = ()  # type: ignore[misc]
    grad, report, _ = _replay(batch, plan)
    planned = sum(len(e.units) for s in plan.trees for e in s.evictions)
    assert report.evicted_units == planned > 0 and report.recomputed_units > 0
    assert report.kept_graphs == sum(len(s.kept) for s in plan.trees) > 0
    floor = noise_floor(MAKE, batch, LOSS)
    assert deviation(grad, flat_gradient(MAKE(), batch, LOSS)).abs <= FACTOR * floor


def _refused(batch: UpdateBatch, plan: ReplayPlan, match: str) -> None:
    model = MAKE()
    model.zero_grad(set_to_none=True)
    with pytest.raises(PlanMismatchError, match=match):
        TreeReplay(model, LOSS, plan).accumulate(batch)
    assert all(p.grad is None for p in model.parameters()), "a refused plan must not leave gradients"


def test_negative_control_a_plan_for_another_walk_is_refused(batch: UpdateBatch) -> None:
    model = MAKE()
    good = ReplayRecipe(config=REPLAY, keep_graph=keep_all).lay_out(batch, model, LOSS)
    assert good.plan.trees is not None
    schedule, units = good.plan.trees[0], good.trees[0].units
    wide = ReplayRecipe(config=replace(REPLAY, microbatch=2)).lay_out(batch, model, LOSS).plan
    _refused(batch, replace(wide, config=REPLAY), "the plan was made for")
    other = make_batch(SHAPES["one_level"](3), LOSS)
    _refused(batch, ReplayRecipe(config=REPLAY).lay_out(other, model, LOSS).plan, "no schedule for tree")
    leaf = next(u.index for u in units.units if not u.children)
    leafy = replace(schedule, kept=schedule.kept | {leaf})
    _refused(batch, replace(good.plan, trees=(leafy,)), f"units \\[{leaf}\\]")
    short = replace(schedule, evictions=schedule.evictions[:1])
    _refused(batch, replace(good.plan, trees=(short,)), "which the plan does not list")


def test_a_bare_config_bounds_nothing(batch: UpdateBatch) -> None:
    """The positive control of the refusals: the same walk without a schedule runs, evicting nothing."""
    grad, report, _ = _replay(batch, ReplayPlan.of(REPLAY))
    laid, laid_report, _ = _replay(batch, ReplayRecipe(config=REPLAY).lay_out(batch, MAKE(), LOSS).plan)
    assert report.evicted_units == laid_report.evicted_units == 0
    assert torch.equal(grad, laid) and report.token_cost == laid_report.token_cost


def test_narrower_is_a_new_recipe_and_a_laid_out_plan_is_not_a_recipe(batch: UpdateBatch) -> None:
    recipe = ReplayRecipe(config=ReplayConfig(microbatch=4), retention=1 << 20)
    narrow = recipe.narrower(2)
    assert (narrow.config.microbatch, recipe.config.microbatch, narrow.retention) == (2, 4, 1 << 20)
    plan = ReplayRecipe(config=REPLAY).lay_out(batch, MAKE(), LOSS).plan
    with pytest.raises(ValueError, match="pass its ReplayRecipe"):
        ReplayRecipe.of(plan)
    assert ReplayRecipe.of(ReplayPlan("flat")).mode == "flat"
