"""The ledger far beyond its probes, and its logits chunk (`replay.max_logit_elements`).

Byte counts only (`MemoryTracker` on CPU is exact and repeatable), never timing. The comparison is on the
dynamic bytes (everything but parameters), as in tests/memory/test_ledger.py.

- At 8192 tokens flat, and at 4096 tokens `exact` and `response_only`, are within the tolerance (the
  longest probe has 1024 tokens). Negative control: the same model calibrated on the short probes alone misses flat's peak
  by more than the tolerance, so the test can tell the two calibrations apart.
- With a 129K-token vocabulary and a tiny hidden size the head's logits chunk sets the peak: lowering
  `max_logit_elements` from 16M to 1M lowers the prediction, changes the plan under a budget between
  the two, and the measured peak of each plan is within the tolerance of its ledger.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.ledger_cases import error, ledger_batch, measured_flat
from support.ledger_cases import measured_tree as measured_tree_peak

from treetrain.loss.loss_config import LossConfig
from treetrain.memory.calibrate import calibrate
from treetrain.memory.calibration_probes import LONG_PROBE, PROBES, probes_for
from treetrain.memory.flat_cost import predict_flat
from treetrain.memory.ledger import predict_ledger
from treetrain.memory.overrides import Overrides
from treetrain.memory.planner import PlanError, plan_update
from treetrain.models.presets import TinySize, tiny_model
from treetrain.replay import ReplayConfig, UpdateBatch

TOLERANCE = 0.10
LOSS = LossConfig()
LONG = 4 * LONG_PROBE
FLAT_LONG = 8 * LONG_PROBE  # the P = 8192: flat's whole sequence, the farthest extrapolation


def make_batch(prefix: int, branches: int, suffix: int, vocab: int) -> UpdateBatch:
    return ledger_batch(prefix, branches, suffix, depth=1, vocab=vocab, loss=LOSS)


def measured_tree(model, batch: UpdateBatch, replay: ReplayConfig):
    return measured_tree_peak(model, batch, replay, LOSS)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 96)


def test_long_probes_fit_the_position_limit() -> None:
    small = tiny_model("llama", 64, size=TinySize(max_positions=300))
    assert max(p.prompt + p.shared + p.turn for p in probes_for(small)) <= 300
    tiny = tiny_model("llama", 64, size=TinySize(max_positions=200))
    assert probes_for(tiny) == PROBES  # no room for a long probe: the short ones alone


def test_flat_at_eight_times_the_longest_probe(model) -> None:
    batch = make_batch(FLAT_LONG, 1, 64, 96)
    measured = measured_flat(model, batch, LOSS)
    ledger, _ = predict_flat(batch, model, LOSS)
    err = error(ledger.peak.dynamic, measured)
    assert abs(err) <= TOLERANCE, (
        f"flat at {FLAT_LONG} tokens: predicted {ledger.peak} vs {measured} B: {err:+.1%}"
    )
    # negative control: calibrated on the short probes alone, the same prediction is outside the tolerance
    short = calibrate(model, "response_only", probes=PROBES)
    wrong, _ = predict_flat(batch, model, LOSS, memory_model=short)
    assert abs(error(wrong.peak.dynamic, measured)) > TOLERANCE, error(wrong.peak.dynamic, measured)


@pytest.mark.parametrize("contract", ["exact", "response_only"])
def test_tree_contracts_at_four_times_the_longest_probe(model, contract) -> None:
    batch = make_batch(LONG, 4, 32, 96)
    replay = ReplayConfig(contract=contract, microbatch=2, chunk_size=512)
    measured = measured_tree(model, batch, replay)
    ledger = predict_ledger(batch, model, replay, LOSS)
    err = error(ledger.peak.dynamic, measured.dynamic)
    assert abs(err) <= TOLERANCE, f"{contract} at {LONG}: predicted {ledger.peak} vs {measured}: {err:+.1%}"


def test_max_logit_elements_changes_prediction_plan_and_measured_peak() -> None:
    vocab = 129_280
    size = TinySize(hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32, max_positions=1024)
    model = tiny_model("llama", vocab, size=size)
    batch = make_batch(64, 4, 40, vocab)
    # response_only: the planner's flat pricing uses the same calibration, so each setting calibrates once
    big, small = (ReplayConfig(contract="response_only", max_logit_elements=n) for n in (1 << 24, 1 << 20))
    # a 16M-element chunk holds 129 rows of this vocabulary (all four branches' 160 targets need two),
    # a 1M one 8: with every branch in one step, far more logits are alive at once with the larger chunk
    assert (1 << 24) // vocab > 40 > (1 << 20) // vocab
    peak = {
        base.max_logit_elements: predict_ledger(batch, model, replace(base, microbatch=0), LOSS).peak.total
        for base in (big, small)
    }
    assert peak[1 << 24] - peak[1 << 20] > 40 * vocab * 4
    budget = (peak[1 << 24] + peak[1 << 20]) // 2
    tree_only = Overrides(mode="tree", chunk_size=0, keep_graphs="none")
    plans = {}
    for base in (big, small):
        try:
            plans[base.max_logit_elements] = plan_update(
                batch, model, budget=budget, base=base, overrides=tree_only
            )
        except PlanError:
            plans[base.max_logit_elements] = None
    plan_small, plan_big = plans[1 << 20], plans[1 << 24]
    assert plan_small is not None and plan_small.microbatch == 0  # every branch in one step fits
    assert plan_big is None or plan_big.microbatch != 0  # the same budget forces fewer branches per step
    for base in (big, small):
        plan = plans[base.max_logit_elements]
        if plan is None:
            continue
        replay = plan.config
        assert replay.max_logit_elements == base.max_logit_elements
        measured = measured_tree(model, batch, replay)
        err = error(plan.ledger.peak.dynamic, measured.dynamic)
        assert abs(err) <= TOLERANCE, f"{replay}: predicted {plan.ledger.peak} vs {measured}: {err:+.1%}"
