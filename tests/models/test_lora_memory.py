"""LoRA adapters (PEFT) in the memory model: the frozen base in the ledger, retention and the tracker
through the PEFT wrapper, and the planner's choice between the fused and the two-walk reference schedule.

The adapters themselves and exact replay against flat are tests/models/test_lora.py; these reuse its
differential check: a bounded update's gradient must still equal the flat run within FACTOR times the
measured noise floor, and the ledger's peak must match the measured one.
"""

from __future__ import annotations

import pytest
import torch
from support.lora_cases import base_model, lora_factory
from support.replay_cases import SHAPES, make_batch

from treetrain.distributed import TorchBackend
from treetrain.distributed.optim_config import OptimizerConfig
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.calibrate import calibrate
from treetrain.memory.ledger import Residency, predict_ledger
from treetrain.memory.overrides import Overrides
from treetrain.memory.persistent import full_finetune_bytes, model_persistent_bytes
from treetrain.memory.planner import plan_update
from treetrain.memory.replay_layout import lay_out
from treetrain.memory.tracker import MemoryTracker
from treetrain.models.lora import AdaptersOff
from treetrain.replay import ReplayConfig, TreeReplay
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor
from treetrain.train.config import load_config

FACTOR = 5.0
KL = LossConfig(kl_coef=0.2, kl_estimator="k3")


# ----- memory: frozen base in the ledger, retention and the tracker through the PEFT wrapper ---------
def test_persistent_bytes_of_a_lora_model_equal_a_real_step() -> None:
    """The ledger books gradients and AdamW state for the adapters only (measured after a real step)."""
    model = lora_factory("llama", torch.float32)()
    backend = TorchBackend(model, OptimizerConfig(lr=1e-3))
    TreeReplay(model, KL, ReplayConfig(), ref_model=AdaptersOff(model)).accumulate(
        make_batch(SHAPES["single"](0), KL)
    )
    grads = sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    backend.optimizer.step()
    state = sum(s[k].numel() * 4 for s in backend.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    predicted = model_persistent_bytes(model, ref_model=AdaptersOff(model), optimizer=True)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert (predicted.params, predicted.grads, predicted.optimizer, predicted.reference) == (
        params,
        grads,
        state,
        0,
    )
    full = full_finetune_bytes(model, reference=True)
    plain = model_persistent_bytes(
        base_model("llama", torch.float32), ref_model=base_model("llama", torch.float32), optimizer=True
    )
    assert full == plain and full.grads > 10 * predicted.grads


def test_lora_under_a_retention_budget_with_kept_graphs_and_the_tracker() -> None:
    """Evicted KV recomputed through the wrapper, kept first-forward graphs, and the memory tracker: the
    gradient still equals flat, and the ledger's peak matches the measured one (frozen base: no grads)."""
    make = lora_factory("llama", torch.float64)
    batch = make_batch(SHAPES["multi_level"](0), KL)
    replay = ReplayConfig(microbatch=1, chunk_size=3)
    model = make()

    def keep(units):
        return frozenset(u.index for u in units.units[1:] if u.children)

    mm = calibrate(model, "exact", with_entropy=False, max_logit_elements=replay.max_logit_elements)
    ref = AdaptersOff(model)
    free = Residency(keep_graph=keep)
    budget = predict_ledger(
        batch, model, replay, KL, residency=free, ref_model=ref, memory_model=mm
    ).minimum_budget
    bounded = Residency(budget, keep_graph=keep)
    ledger = predict_ledger(batch, model, replay, KL, residency=bounded, ref_model=ref, memory_model=mm)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    tracker = MemoryTracker()
    schedule = lay_out(
        batch, model, KL, replay, retention=budget, keep_graph=keep, ref_model=AdaptersOff(model)
    ).schedule
    engine = TreeReplay(model, KL, replay, ref_model=AdaptersOff(model), hooks=ReplayHooks(tracker=tracker))
    report = engine.accumulate(batch, schedule)
    tracker.detach()
    assert report.recomputed_units > 0 and report.kept_graphs > 0
    floor = noise_floor(make, batch, KL, adapters_off_reference=True)
    flat_model = make()
    flat = flat_gradient(flat_model, batch, KL, AdaptersOff(flat_model))
    assert deviation(flat_grad(model), flat).abs <= FACTOR * floor
    measured = report.measured_peak
    assert measured is not None
    assert abs(ledger.peak.dynamic - measured.dynamic) <= 0.10 * measured.dynamic, (ledger.peak, measured)
    kinds = [r.kind for r in ledger.rows]  # the reference's rows sit in the scoring walk, before any step
    assert (
        report.reference_walks == 0
        and "reference" in kinds
        and kinds.index("reference") < kinds.index("step")
    )


def test_planner_budgets_both_kv_sets_and_falls_back_to_two_walks() -> None:
    """The fused walk's retention minimum counts the reference's KV too; a retention budget that only the
    two-walk schedule fits makes the planner choose it and say so, and that update still equals flat."""
    make = lora_factory("llama", torch.float64)
    batch = make_batch(SHAPES["one_level"](0), KL)
    model = make()
    ref = AdaptersOff(model)
    fixed = {"microbatch": 2, "chunk_size": 5}
    mins = {
        walk: predict_ledger(
            batch,
            model,
            ReplayConfig(**fixed, reference_walk=walk),
            KL,
            ref_model=ref,  # type: ignore[arg-type]
        ).minimum_budget
        for walk in ("fused", "separate")
    }
    assert mins["fused"] > mins["separate"] > 0
    forced = {"mode": "tree", **fixed, "keep_graphs": "none"}
    roomy = plan_update(batch, model, budget=1 << 30, loss=KL, ref_model=ref, overrides=Overrides(**forced))
    assert roomy.mode == "tree" and roomy.reference_walk == "fused"
    assert "scored in the scoring walk" in roomy.explain()
    tight = Overrides(**forced, retention=mins["separate"])
    plan = plan_update(batch, model, budget=1 << 30, loss=KL, ref_model=ref, overrides=tight)
    assert plan.reference_walk == "separate" and "runs as a second walk" in plan.explain()
    bounded = plan.lay_out(batch, model, KL, ref).schedule
    report = TreeReplay(model, KL, plan.config, ref_model=ref).accumulate(batch, bounded)
    assert report.reference_walks == len(batch.work) and report.evicted_units > 0
    floor = noise_floor(make, batch, KL, adapters_off_reference=True)
    flat_model = make()
    flat = flat_gradient(flat_model, batch, KL, AdaptersOff(flat_model))
    assert deviation(flat_grad(model), flat).abs <= FACTOR * floor


def test_plan_compares_adapters_with_full_finetuning() -> None:
    from treetrain.cli.plan import lora_text, lora_vs_full
    from treetrain.train.models import load_models

    cfg = load_config(
        None, ["model.path=tiny-llama", "model.lora.r=4", "loss.kl_coef=0.1", "model.reference=base"]
    )
    lora, full = lora_vs_full(load_models(cfg.model), cfg)
    assert lora.reference == 0 and full.reference == full.params > 0
    assert lora.params > full.params and lora.grads < full.grads and lora.optimizer < full.optimizer
    text = lora_text(lora, full)
    assert "full fine-tuning, same model" in text and "LoRA saves" in text


def test_planner_takes_the_walk_with_the_lower_peak_when_neither_fits(monkeypatch) -> None:
    """When neither walk fits, the plan (and the refusal's smallest tree peak) is the walk that comes
    closer: here the second walk, though the fused one was searched first."""
    from types import SimpleNamespace

    import treetrain.memory.planner as planner

    peaks = {"fused": 900_000_000, "separate": 500_000_000}

    def nothing_fits(search, *args):
        peak = peaks[search.base.reference_walk]
        search.smallest = SimpleNamespace(
            ledger=SimpleNamespace(peak=SimpleNamespace(total=peak), token_cost=1)
        )
        return None

    monkeypatch.setattr(planner, "search_tree", nothing_fits)
    model = lora_factory("llama", torch.float64)()
    batch = make_batch(SHAPES["one_level"](0), KL)
    with pytest.raises(planner.PlanError, match=r"smallest predicted peak is 476\.8 MiB in tree mode"):
        plan_update(batch, model, budget=1, loss=KL, ref_model=AdaptersOff(model))
