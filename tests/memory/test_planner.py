"""The planner: tree when a long prefix is shared by many branches, flat when suffixes dominate, budgets
respected (and checked by running the plan), overrides obeyed, impossible budgets refused by name."""

from __future__ import annotations

import pytest
import torch
from support.replay_cases import VOCAB

from treetrain.bytesize import format_bytes
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.overrides import Overrides
from treetrain.memory.planner import KeptGraphs, PlanError, plan_update
from treetrain.memory.retention import BudgetTooSmallError
from treetrain.memory.tracker import MemoryTracker
from treetrain.models.presets import tiny_model
from treetrain.replay import ReplayConfig, TreeReplay, UpdateBatch
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.tree.synthetic import synthetic_group

LARGE = 1 << 30


def batch_of(prefix: int, branches: int, suffix: int, depth: int = 1) -> UpdateBatch:
    rewards = [float(i % 3 == 0) for i in range(branches)]
    tree = synthetic_group(
        prefix=prefix, branches=branches, suffix=suffix, depth=depth, vocab=VOCAB, seed=2, rewards=rewards
    )
    adv = compute_advantages([tree], AdvantageConfig())
    return UpdateBatch.build([tree], adv.trees, LossConfig())


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", VOCAB)


def test_tree_when_a_long_prefix_is_shared_by_many_branches(model) -> None:
    plan = plan_update(batch_of(256, 8, 8), model, budget=LARGE)
    assert plan.mode == "tree"
    assert plan.speedup > 4
    assert plan.tree.token_cost < plan.flat.token_cost
    text = plan.explain()
    assert "tree:" in text and "flat:" in text and "FLOPs" in text and "peak" in text


def test_flat_when_suffixes_dominate(model) -> None:
    plan = plan_update(batch_of(4, 2, 200), model, budget=LARGE)
    assert plan.mode == "flat"
    assert plan.speedup < plan.min_speedup
    assert any("suffixes dominate" in r for r in plan.reasons)
    assert plan.ledger.peak.total == plan.flat.peak


def test_tight_budget_is_met_and_the_run_stays_within_it(model) -> None:
    batch = batch_of(96, 8, 12, depth=2)
    loose = plan_update(batch, model, budget=LARGE, overrides=Overrides(mode="tree", keep_graphs="none"))
    budget = int(0.9 * loose.tree.peak)
    plan = plan_update(batch, model, budget=budget, overrides=Overrides(mode="tree", keep_graphs="none"))
    assert plan.ledger.peak.total <= budget
    assert (plan.microbatch, plan.chunk_size, plan.retention) != (
        loose.microbatch,
        loose.chunk_size,
        loose.retention,
    )
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tracker = MemoryTracker()
    laid = plan.lay_out(batch, model, LossConfig())
    engine = TreeReplay(model, LossConfig(), plan.config, hooks=ReplayHooks(tracker=tracker))
    report = engine.accumulate(batch, laid.schedule)
    tracker.detach()
    assert report.measured_peak is not None
    assert report.measured_peak.total <= 1.05 * budget
    assert report.token_cost == plan.tree.token_cost


def test_kept_graphs_are_chosen_when_memory_allows_and_lower_the_cost(model) -> None:
    batch = batch_of(64, 8, 12, depth=2)
    none = plan_update(batch, model, budget=LARGE, overrides=Overrides(mode="tree", keep_graphs="none"))
    auto = plan_update(batch, model, budget=LARGE, overrides=Overrides(mode="tree"))
    assert auto.keep_graph and not none.keep_graph
    assert auto.tree.token_cost < none.tree.token_cost
    keep = KeptGraphs(auto.keep_graph)
    from treetrain.replay.units import UnitTree

    work = batch.work[0]
    assert keep(UnitTree.build(work.tree, work.targets, auto.chunk_size))


def test_overrides_are_obeyed(model) -> None:
    batch = batch_of(256, 8, 8)
    plan = plan_update(batch, model, budget=LARGE, overrides=Overrides(mode="flat", microbatch=2))
    assert plan.mode == "flat" and plan.microbatch == 2 and plan.forced == ("mode", "microbatch")
    plan = plan_update(
        batch,
        model,
        budget=LARGE,
        overrides=Overrides(mode="tree", microbatch=1, chunk_size=64, keep_graphs="none"),
    )
    assert (plan.mode, plan.microbatch, plan.chunk_size, plan.keep_graph) == ("tree", 1, 64, frozenset())
    assert plan.config.microbatch == 1 and plan.config.chunk_size == 64
    with pytest.raises(ValueError, match="keep_graphs"):
        Overrides(keep_graphs="some")  # type: ignore[arg-type]


def test_forced_retention_below_the_minimum_names_it(model) -> None:
    with pytest.raises(BudgetTooSmallError, match=r"minimum feasible budget \d+ B"):
        plan_update(
            batch_of(64, 4, 8),
            model,
            budget=LARGE,
            overrides=Overrides(mode="tree", microbatch=1, chunk_size=0, retention=10),
        )


def test_budget_nothing_fits_in_is_refused_with_the_smallest_peak(model) -> None:
    with pytest.raises(PlanError, match="smallest predicted peak"):
        plan_update(batch_of(64, 4, 8), model, budget=1000)
    with pytest.raises(ValueError, match="budget"):
        plan_update(batch_of(64, 4, 8), model, budget=0)


@pytest.mark.parametrize("mode", ["tree", "flat"])
def test_a_forced_mode_over_its_budget_says_so_in_one_line(model, mode: str) -> None:
    """The planner keeps a forced mode even when it does not fit; `over_budget` names its smallest peak, the
    budget and what to change (the trainer refuses the plan with it, `treetrain plan` shows it)."""
    batch = batch_of(64, 4, 8)
    roomy = plan_update(batch, model, budget=LARGE, overrides=Overrides(mode=mode))  # type: ignore[arg-type]
    assert roomy.over_budget is None and "refused" not in roomy.explain()  # the control: it fits
    tight = plan_update(batch, model, budget=1000, overrides=Overrides(mode=mode))  # type: ignore[arg-type]
    chosen = tight.tree if mode == "tree" else tight.flat
    line = tight.over_budget
    assert line is not None and "\n" not in line
    assert line.startswith(
        f"mode={mode} was forced, and its smallest predicted peak {format_bytes(chosen.peak)}"
    )
    assert "exceeds memory_budget 1000 B" in line and f"at least {format_bytes(chosen.peak)}" in line
    assert f"refused by train: {line}" in tight.explain()


def test_contract_is_planned_as_given(model) -> None:
    batch = batch_of(128, 8, 8)
    exact = plan_update(batch, model, budget=LARGE, overrides=Overrides(mode="tree", keep_graphs="none"))
    detached = plan_update(
        batch,
        model,
        budget=LARGE,
        base=ReplayConfig(contract="response_only"),
        overrides=Overrides(mode="tree"),
    )
    assert detached.contract == "response_only" and detached.config.contract == "response_only"
    assert not detached.keep_graph  # kept graphs are an `exact` optimization
    assert detached.tree.token_cost < exact.tree.token_cost  # no backward into the shared prefix
