"""The plan laid out for one rank is immutable and complete, and the replayer carries it out as given.

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

from treetrain.loss.loss_config import LossConfig
from treetrain.memory.overrides import Overrides
from treetrain.memory.planner import plan_update
from treetrain.memory.replay_layout import lay_out
from treetrain.replay import ReplayConfig, ReplayReport, TreeReplay, UpdateBatch
from treetrain.replay.replay_schedule import PlanMismatchError, ReplaySchedule
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


def _replay(
    batch: UpdateBatch, schedule: ReplaySchedule | None
) -> tuple[torch.Tensor, ReplayReport, torch.nn.Module]:
    model = MAKE()
    model.zero_grad(set_to_none=True)
    report = TreeReplay(model, LOSS, REPLAY).accumulate(batch, schedule)
    return flat_grad(model), report, model


def test_the_plan_is_immutable_and_complete_and_the_engine_carries_it_out(batch: UpdateBatch) -> None:
    model = MAKE()
    free = lay_out(batch, model, LOSS, REPLAY, keep_graph=keep_all)
    minimum = max(p.minimum for p in free.retention)
    layout = lay_out(batch, model, LOSS, REPLAY, retention=minimum, keep_graph=keep_all)
    plan = layout.schedule
    assert [s.tree_id for s in plan.trees] == [w.tree.id for w in batch.work]
    for schedule, tree in zip(plan.trees, layout.trees):
        listed = [
            (use.event, evicted)
            for use, evicted in zip(tree.uses, tree.retention.evict)
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


def _refused(batch: UpdateBatch, schedule: ReplaySchedule, match: str) -> None:
    model = MAKE()
    model.zero_grad(set_to_none=True)
    with pytest.raises(PlanMismatchError, match=match):
        TreeReplay(model, LOSS, REPLAY).accumulate(batch, schedule)
    assert all(p.grad is None for p in model.parameters()), "a refused plan must not leave gradients"


def test_negative_control_a_plan_for_another_walk_is_refused(batch: UpdateBatch) -> None:
    model = MAKE()
    good = lay_out(batch, model, LOSS, REPLAY, keep_graph=keep_all)
    schedule, units = good.schedule.trees[0], good.trees[0].units
    wide = lay_out(batch, model, LOSS, replace(REPLAY, microbatch=2)).schedule
    _refused(batch, wide, "the plan was made for")
    other = make_batch(SHAPES["one_level"](3), LOSS)
    _refused(batch, lay_out(other, model, LOSS, REPLAY).schedule, "no schedule for tree")
    leaf = next(u.index for u in units.units if not u.children)
    leafy = replace(schedule, kept=schedule.kept | {leaf})
    _refused(batch, replace(good.schedule, trees=(leafy,)), f"units \\[{leaf}\\]")
    short = replace(schedule, evictions=schedule.evictions[:1])
    _refused(batch, replace(good.schedule, trees=(short,)), "which the plan does not list")


def test_a_bare_config_bounds_nothing(batch: UpdateBatch) -> None:
    """The positive control of the refusals: the same walk without a schedule runs, evicting nothing."""
    grad, report, _ = _replay(batch, None)
    laid, laid_report, _ = _replay(batch, lay_out(batch, MAKE(), LOSS, REPLAY).schedule)
    assert report.evicted_units == laid_report.evicted_units == 0
    assert torch.equal(grad, laid) and report.token_cost == laid_report.token_cost


def test_narrower_is_a_new_plan_laid_out_afresh(batch: UpdateBatch) -> None:
    """After an out-of-memory error the update narrows its plan: a new `Plan` with the smaller K and every
    other choice kept, whose layout has the narrower steps; the first plan and its layout are unchanged."""
    model = MAKE()
    forced = Overrides(mode="tree", microbatch=4, chunk_size=3, keep_graphs="none")
    plan = plan_update(batch, model, budget=1 << 34, overrides=forced)
    narrow = plan.narrower(1)
    assert (narrow.microbatch, plan.microbatch) == (1, 4)
    assert (narrow.retention, narrow.chunk_size, narrow.keep_graph) == (plan.retention, 3, plan.keep_graph)
    wide_steps = [len(s.steps) for s in plan.lay_out(batch, model, LOSS).schedule.trees]
    narrow_steps = [len(s.steps) for s in narrow.lay_out(batch, model, LOSS).schedule.trees]
    assert all(n >= w for n, w in zip(narrow_steps, wide_steps)) and sum(narrow_steps) > sum(wide_steps)
    assert narrow_steps == [len(s.steps) for s in lay_out(batch, model, LOSS, REPLAY).schedule.trees]
