"""The ledger predicts the measured peak within +-10%, and the tracker that measures it is exact.

Measured = `MemoryTracker` (live tensor bytes by storage, deterministic on CPU) attached to the engine.
Predicted = `predict_ledger`, calibrated on the same tiny model. The comparison is on the *dynamic* bytes
(everything but parameters), which the schedule controls; comparing totals would let the parameters hide
errors. Gradients are allocated before the run because the ledger books them for the whole window.
"""

from __future__ import annotations

import pytest
import torch
from support.replay_cases import VOCAB

from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.calibrate import calibrate
from treetrain.memory.ledger import Residency, predict_ledger
from treetrain.memory.persistent import kv_bytes_per_token, model_persistent_bytes, persistent_bytes
from treetrain.memory.replay_layout import lay_out
from treetrain.memory.tracker import MemoryTracker
from treetrain.models.presets import tiny_model
from treetrain.replay import (
    ReplayConfig,
    ResidentIdentity,
    ResidentStore,
    TreeReplay,
    UpdateBatch,
)
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.resident import ResidentKey
from treetrain.tree.synthetic import synthetic_group

TOLERANCE = 0.10


def make_batch(prefix: int, branches: int, suffix: int, depth: int, loss: LossConfig) -> UpdateBatch:
    rewards = [float(i % 3 == 0) for i in range(branches)]
    tree = synthetic_group(
        prefix=prefix, branches=branches, suffix=suffix, depth=depth, vocab=VOCAB, seed=1, rewards=rewards
    )
    adv = compute_advantages([tree], AdvantageConfig())
    return UpdateBatch.build([tree], adv.trees, loss)


def measure(model, batch: UpdateBatch, loss: LossConfig, replay: ReplayConfig, ref_model=None, **plan_kw):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tracker = MemoryTracker()
    schedule = lay_out(batch, model, loss, replay, ref_model=ref_model, **plan_kw).schedule
    engine = TreeReplay(model, loss, replay, ref_model=ref_model, hooks=ReplayHooks(tracker=tracker))
    report = engine.accumulate(batch, schedule)
    tracker.detach()
    return report, tracker


GRID = [
    # prefix, branches (G), suffix, depth, K, contract
    (48, 4, 12, 1, 0, "exact"),
    (96, 8, 16, 1, 2, "exact"),
    (24, 6, 40, 2, 0, "exact"),
    (128, 4, 8, 3, 1, "exact"),
    (64, 16, 10, 2, 0, "exact"),
    (48, 4, 12, 1, 0, "response_only"),
    (96, 8, 16, 2, 2, "response_only"),
    (16, 8, 64, 1, 4, "response_only"),
]


@pytest.mark.parametrize(("prefix", "branches", "suffix", "depth", "k", "contract"), GRID)
def test_predicted_peak_matches_measured(prefix, branches, suffix, depth, k, contract) -> None:
    loss = LossConfig()
    batch = make_batch(prefix, branches, suffix, depth, loss)
    model = tiny_model("llama", VOCAB)
    replay = ReplayConfig(contract=contract, microbatch=k)
    ledger = predict_ledger(batch, model, replay, loss)
    report, _ = measure(model, batch, loss, replay)
    measured = report.measured_peak
    assert measured is not None
    err = (ledger.peak.dynamic - measured.dynamic) / measured.dynamic
    assert abs(err) <= TOLERANCE, f"predicted {ledger.peak} vs measured {measured}: {err:+.1%}"
    assert ledger.peak.persistent == measured.persistent  # parameters are counted, not estimated
    assert ledger.token_cost == report.token_cost


@pytest.mark.parametrize(
    ("loss", "budget_fraction", "keep"),
    [
        (LossConfig(kl_coef=0.1), None, False),
        (LossConfig(entropy_coef=0.01), None, False),
        (LossConfig(), 0.0, False),
        (LossConfig(), None, True),
        (LossConfig(), 0.3, True),
    ],
    ids=["kl", "entropy", "min-budget", "kept-graphs", "budget+kept"],
)
def test_prediction_holds_with_reference_budgets_and_kept_graphs(loss, budget_fraction, keep) -> None:
    batch = make_batch(48, 8, 12, 3, loss)
    model = tiny_model("llama", VOCAB)
    ref = tiny_model("llama", VOCAB, seed=5) if loss.needs_reference else None
    replay = ReplayConfig(microbatch=1)
    keep_graph = (lambda units: frozenset(u.index for u in units.units if u.children)) if keep else None
    budget = None
    if budget_fraction is not None:
        free = predict_ledger(
            batch, model, replay, loss, ref_model=ref, residency=Residency(keep_graph=keep_graph)
        )
        resident = max(r.bytes.prompt_group for r in free.rows)
        budget = int(free.minimum_budget + budget_fraction * (resident - free.minimum_budget))
    ledger = predict_ledger(
        batch, model, replay, loss, residency=Residency(budget, keep_graph=keep_graph), ref_model=ref
    )
    report, _ = measure(model, batch, loss, replay, ref_model=ref, keep_graph=keep_graph, retention=budget)
    measured = report.measured_peak
    assert measured is not None
    err = (ledger.peak.dynamic - measured.dynamic) / measured.dynamic
    assert abs(err) <= TOLERANCE, f"predicted {ledger.peak} vs measured {measured}: {err:+.1%}"
    assert ledger.token_cost == report.token_cost
    if keep:
        assert report.kept_graphs > 0


def test_host_tier_ledger_copies_back_instead_of_recomputing() -> None:
    """Costs only: on a CPU the host tier's copies are the same memory, so there is no peak to compare."""
    loss = LossConfig()
    batch = make_batch(48, 8, 12, 3, loss)
    model = tiny_model("llama", VOCAB)
    replay = ReplayConfig(microbatch=1, chunk_size=8)
    budget = predict_ledger(batch, model, replay, loss).minimum_budget
    ledger = predict_ledger(batch, model, replay, loss, residency=Residency(budget, host_tier=True))
    report, _ = measure(model, batch, loss, replay, retention=budget, host_tier=True)
    assert ledger.recomputes == report.restored_units > 0
    assert any(r.kind == "restore" for r in ledger.rows) and not any(
        r.kind == "recompute" for r in ledger.rows
    )
    assert ledger.token_cost == report.token_cost


def test_negative_control_a_wrong_schedule_is_caught() -> None:
    """The ledger of another K (all siblings instead of one at a time) is far outside the tolerance."""
    loss = LossConfig()
    batch = make_batch(32, 8, 40, 1, loss)
    model = tiny_model("llama", VOCAB)
    wrong = predict_ledger(batch, model, ReplayConfig(microbatch=0), loss)
    report, _ = measure(model, batch, loss, ReplayConfig(microbatch=1))
    assert report.measured_peak is not None
    assert (
        abs(wrong.peak.dynamic - report.measured_peak.dynamic) > 2 * TOLERANCE * report.measured_peak.dynamic
    )


def test_a_partly_frozen_twin_is_calibrated_apart() -> None:
    """Calibrations are cached per configuration, and which parameters train is part of it: a frozen weight
    saves no input for its gradient, so a process that calibrated a partly frozen twin first (a LoRA test
    on the same tiny model, say) must not lend that calibration to the full model."""
    loss = LossConfig()
    batch = make_batch(48, 8, 12, 3, loss)
    replay = ReplayConfig(microbatch=1)
    keep = Residency(keep_graph=lambda units: frozenset(u.index for u in units.units if u.children))
    frozen = tiny_model("llama", VOCAB)
    for name, p in frozen.named_parameters():
        p.requires_grad_("embed" not in name and "proj" not in name)

    def fitted(model, cache: bool = True):
        return calibrate(model, replay.contract, max_logit_elements=replay.max_logit_elements, cache=cache)

    def peak(memory_model=None) -> int:
        ledger = predict_ledger(
            batch, tiny_model("llama", VOCAB), replay, loss, residency=keep, memory_model=memory_model
        )
        return ledger.peak.dynamic

    fresh = peak(fitted(tiny_model("llama", VOCAB), cache=False))
    twin = peak(fitted(frozen))
    assert peak() == fresh  # the cache, holding the twin's calibration, gives the full model its own
    assert abs(twin - fresh) > TOLERANCE * fresh  # negative control: the twin's would fail the ledger tests


def test_ledger_table_names_the_peak_and_its_cause() -> None:
    loss = LossConfig()
    ledger = predict_ledger(make_batch(48, 4, 12, 1, loss), tiny_model("llama", VOCAB), ReplayConfig(), loss)
    assert ledger.rows[ledger.peak_step].bytes == ledger.peak
    assert "replay step" in ledger.peak_cause or "scoring" in ledger.peak_cause
    text = ledger.table()
    assert "<- peak" in text and "prompt_group" in text
    assert ledger.as_dict()["peak_step"] == ledger.peak_step


# ----- the tracker -------------------------------------------------------------------------------------------
def test_tracker_counts_storages_once_and_frees_them() -> None:
    with MemoryTracker() as mt:
        a = torch.zeros(1000)  # 4000 bytes
        views = [a[:10], a.view(10, 100), a[::2]]
        b = a.add_(1)  # in place: same storage
        assert mt.current.temporary == 4000
        del a, b, views
        assert mt.current.temporary == 0
        c = torch.ones(10) * 3  # the ones() temporary dies at once
        assert mt.current.temporary == 40
    assert mt.peak.temporary == 4000
    assert c.sum() == 30


def test_tracker_classifies_by_lifetime() -> None:
    model = tiny_model("llama", VOCAB)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    identity = ResidentIdentity.of(model)
    store = ResidentStore(identity)
    mt = MemoryTracker()
    mt.attach_model(model)
    mt.attach_store(store)
    with mt:
        kv = [(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8))]
        store.put(ResidentKey("t", 1, "n"), kv, identity)
        out = model(torch.tensor([[1, 2, 3]])).logits.sum()
        out.backward()
        del out
    now = mt.current
    assert now.persistent == params
    assert now.prompt_group == 2 * 2 * 8 * 8 * 4
    assert now.boundary == params  # every parameter got a gradient
    mt.detach()


def test_measurement_is_deterministic() -> None:
    loss = LossConfig()
    batch = make_batch(40, 4, 12, 2, loss)
    peaks = [
        measure(tiny_model("llama", VOCAB), batch, loss, ReplayConfig(microbatch=2))[0].measured_peak
        for _ in range(2)
    ]
    assert peaks[0] == peaks[1]


def test_report_has_no_measured_peak_without_a_tracker() -> None:
    loss = LossConfig()
    report = TreeReplay(tiny_model("llama", VOCAB), loss, ReplayConfig()).accumulate(
        make_batch(16, 2, 6, 1, loss)
    )
    assert report.measured_peak is None


# ----- run-persistent bytes ------------------------------------------------------------------------------------
def test_persistent_bytes_per_zero_stage() -> None:
    n, w = 1000, 4
    stage = [persistent_bytes(n, "bfloat16", zero_stage=s, world_size=w) for s in range(4)]
    assert (stage[0].params, stage[0].grads, stage[0].optimizer, stage[0].master) == (2000, 2000, 8000, 4000)
    assert (stage[1].params, stage[1].grads, stage[1].optimizer, stage[1].master) == (2000, 2000, 2000, 1000)
    assert (stage[2].params, stage[2].grads) == (2000, 2000)  # whole inside the window
    assert (stage[3].params, stage[3].grads, stage[3].in_flight) == (500, 2000, 0)
    fp32 = persistent_bytes(n, "float32")
    assert fp32.master == 0  # no separate master copy for fp32 parameters
    off = persistent_bytes(n, "bfloat16", offload_optimizer=True)
    assert off.run_persistent == 2000 and off.host == 12000
    ref = persistent_bytes(n, "bfloat16", reference_params=n, zero_stage=3, world_size=w)
    assert ref.reference == 2000  # a full replica on every rank
    gathered = persistent_bytes(n, "bfloat16", zero_stage=3, world_size=w, largest_module_params=100)
    assert gathered.in_flight == 400 and gathered.run_persistent == 500 + 400 + 2000 + 1000
    assert (
        persistent_bytes(n, "bfloat16", zero_stage=2, world_size=w, largest_module_params=100).in_flight == 0
    )
    with pytest.raises(ValueError, match="zero_stage"):
        persistent_bytes(n, "float32", zero_stage=4)


def test_model_persistent_bytes_and_kv_size_come_from_the_model() -> None:
    model = tiny_model("llama", VOCAB)
    b = model_persistent_bytes(model)
    assert b.params == sum(p.numel() * 4 for p in model.parameters())
    config = model.config
    assert kv_bytes_per_token(model) == 2 * config.num_hidden_layers * config.num_key_value_heads * 8 * 4


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "gemma4_text", "gpt2"])
def test_resident_kv_bytes_per_token_are_what_the_cache_holds(family: str) -> None:
    """The ledger's per-token KV size against the cache a forward returns: MLA caches latents, and Gemma 4's
    reusing layers cache nothing (a size from heads x head size would be several times off for both)."""
    from treetrain.memory.persistent import kv_bytes_per_token
    from treetrain.models.decoder import decoder_forward
    from treetrain.models.presets import tiny_model

    model = tiny_model(family, 64)
    ids = torch.arange(1, 6)[None]
    with torch.no_grad():
        out = decoder_forward(model, ids, torch.arange(5)[None], None)
    cached = sum(t.numel() * t.element_size() for t in (*out.keys, *out.values)) // 5
    assert kv_bytes_per_token(model) == cached


@pytest.mark.parametrize("contract", ["exact", "response_only"])
def test_a_latent_attention_models_expanded_past_is_priced(contract: str) -> None:
    """Multi-head latent attention keeps latents resident but expands every piece of the past to full keys
    and values once per layer of a step (not per row) and keeps them for the backward: bytes per past token,
    whatever the rows. Replayed one row at a time over a long chunked prefix, that expansion is most of the
    step (the calibration's per-past-token feature prices it). Held to 5 %, half the usual tolerance: with
    that feature's cost forced to zero (run by hand) the prediction was 18-21 % under the measured peak."""
    loss = LossConfig()
    batch = make_batch(1000, 4, 8, 1, loss)
    model = tiny_model("deepseek_v3", VOCAB)
    replay = ReplayConfig(contract=contract, microbatch=1, chunk_size=32)  # type: ignore[arg-type]
    ledger = predict_ledger(batch, model, replay, loss)
    report, _ = measure(model, batch, loss, replay)
    measured = report.measured_peak
    assert measured is not None
    err = (ledger.peak.dynamic - measured.dynamic) / measured.dynamic
    assert abs(err) <= 0.05, f"predicted {ledger.peak} vs measured {measured}: {err:+.1%}"
