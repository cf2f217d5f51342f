"""Recurrent layers (Gated DeltaNet, Kimi delta attention, Mamba, Mamba-2, RWKV) and hybrids: `exact` equals the flat reference.

A recurrent layer's resident object is its (conv state, recurrent state) before a unit's last token,
not KV (`treetrain.models.recurrent_state`); a hybrid layer's (Zamba 2, Falcon-H1: attention and a Mamba-2
mixer in one layer) is both, one `HybridEntry` (`treetrain.models.layer_entry`). The checks are the ones every KV family passes
(test_replay_exact.py): `exact` against the flat reference at FACTOR times the noise floor measured in the
same case, through trees of several levels, K, order, chunking and a retention budget, with LoRA; and
negative controls that show the check sees the recurrent state's gradient: leaving it out of G, or the
`response_only` contract that detaches it, is caught far above the bound; for a hybrid layer, leaving
either part of its entry out of G is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.lora_cases import lora_factory
from support.replay_cases import SHAPES, VOCAB, factory, make_batch

from treetrain.loss.loss_config import LossConfig
from treetrain.memory.persistent import kv_bytes_per_token, state_bytes_per_unit, unit_resident_bytes
from treetrain.memory.replay_layout import lay_out
from treetrain.memory.tracker import MemoryTracker
from treetrain.models.decoder import decoder_forward
from treetrain.models.layer_entry import entry_bytes
from treetrain.models.presets import (
    EAGER_ONLY,
    HYBRID_FAMILIES,
    KIMI_DELTA_FAMILIES,
    MAMBA2_FAMILIES,
    MAMBA_FAMILIES,
    RECURRENT_FAMILIES,
    tiny_model,
)
from treetrain.models.recurrent_kinds import Kind
from treetrain.models.recurrent_state import hybrid_layers, mixers, recurrent_layers
from treetrain.models.support import SupportGate, UnsupportedModelError, check_supported
from treetrain.replay import ReplayConfig, TreeReplay
from treetrain.replay.pieces import own_kv, pad_pieces
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.units import UnitTree
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor, tree_gradient

FACTOR = 5.0
#: Presets whose layers are all recurrent: Mamba layers only, RWKV's WKV time mixing in every block.
NO_ATTENTION = ("mamba", "falcon_mamba", "rwkv")
DTYPES = {"float64": torch.float64, "float32": torch.float32}
SLOWEST = pytest.mark.slow
"""The cases that take 10-30 s each on one core (one-token chunks, the KDA kernels' ledger, a second hybrid
under a budget): `make test` runs them, `make test-fast` runs the same tests on the other cases."""


def _check(
    family: str,
    dtype: torch.dtype,
    shape: str,
    loss: LossConfig,
    replay: ReplayConfig,
    *,
    trusting: bool = False,
):
    attn = "eager" if family in EAGER_ONLY else "sdpa"
    make = factory(family, dtype, attn)
    make_ref = factory(family, dtype, attn, seed=7) if loss.needs_reference else None
    batch = make_batch(SHAPES[shape](0), loss)
    floor = noise_floor(make, batch, loss, make_ref)
    flat = flat_gradient(make(), batch, loss, make_ref() if make_ref else None)
    if trusting:  # a negative control the support probe refuses by itself: run it past the probe
        model = make()
        model.zero_grad(set_to_none=True)
        TreeReplay(model, loss, replay, support=SupportGate(trusting=True)).accumulate(batch)
        tree = flat_grad(model)
    else:
        tree = tree_gradient(make(), batch, loss, replay, make_ref() if make_ref else None)
    assert float(flat.norm()) > 0, "the case produced no gradient at all"
    return deviation(tree, flat), floor


def test_presets_mix_recurrent_and_attention_layers() -> None:
    """The cases below exercise both kinds of resident state, chained through the layers."""
    for family in RECURRENT_FAMILIES:
        model = tiny_model(family, VOCAB, attn="eager" if family in EAGER_ONLY else "sdpa")
        layers = recurrent_layers(model)
        assert layers, family
        hybrid = hybrid_layers(model)
        assert bool(hybrid) == (family in HYBRID_FAMILIES) and hybrid <= layers, family
        if family not in NO_ATTENTION:
            assert len(layers - hybrid) < model.config.num_hidden_layers, family  # some layers attend
        kinds = {kind.name for _, kind in mixers(model).values()}
        expected = (
            "wkv"
            if family == "rwkv"
            else "mamba2"
            if family in MAMBA2_FAMILIES
            else "mamba"
            if family in MAMBA_FAMILIES
            else "kimi_delta"
            if family in KIMI_DELTA_FAMILIES
            else "gated_deltanet"
        )
        assert kinds == {expected}, family


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_exact_matches_flat_recurrent_families(family: str, dtype: str) -> None:
    replay = ReplayConfig(microbatch=2, chunk_size=5)
    dev, floor = _check(family, DTYPES[dtype], "multi_level", LossConfig(), replay)
    assert dev.abs <= FACTOR * floor, (
        f"{family}/{dtype}: |exact - flat| = {dev.abs:.3e} > {FACTOR} x {floor:.3e}"
    )


@pytest.mark.parametrize("family", ["qwen3_5_text", "zamba2", "rwkv"])
@pytest.mark.parametrize(
    "replay",
    [
        ReplayConfig(microbatch=1, order="reverse"),
        ReplayConfig(microbatch=0, order="shuffle", seed=4),
        pytest.param(ReplayConfig(microbatch=1, chunk_size=1), marks=SLOWEST),
        ReplayConfig(microbatch=2, chunk_size=3, order="shuffle", seed=3),
        ReplayConfig(microbatch=0, chunk_size=7, score_microbatch=1),
    ],
    ids=lambda r: f"K{r.microbatch}-{r.order}-chunk{r.chunk_size}",
)
def test_exact_recurrent_invariant_to_order_k_and_chunking(replay: ReplayConfig, family: str) -> None:
    """Two trees, KL to a separate reference and entropy; one-token chunks carry state through every token
    (for Zamba 2 both parts of every hybrid layer's entry)."""
    loss = LossConfig(kl_coef=0.05, entropy_coef=0.01)
    dev, floor = _check(family, torch.float64, "two_trees", loss, replay)
    assert dev.abs <= FACTOR * floor, f"{replay}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
@pytest.mark.parametrize(
    "replay",
    [
        pytest.param(ReplayConfig(microbatch=1, chunk_size=1), marks=SLOWEST),
        ReplayConfig(microbatch=2, chunk_size=3, order="shuffle", seed=3),
    ],
    ids=lambda r: f"K{r.microbatch}-{r.order}-chunk{r.chunk_size}",
)
def test_exact_kda_two_trees_with_a_reference(family: str, replay: ReplayConfig) -> None:
    """KDA under KL to a separate reference and entropy, in one-token chunks (every token carries the
    per-channel gated state on) and shuffled with K = 2."""
    loss = LossConfig(kl_coef=0.05, entropy_coef=0.01)
    dev, floor = _check(family, torch.float64, "two_trees", loss, replay)
    assert dev.abs <= FACTOR * floor, f"{family} {replay}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize(
    "family", ["qwen3_next", "kimi_linear", "mamba", "bamba", "zamba2", "falcon_h1", "zamba", "rwkv"]
)
@pytest.mark.parametrize("shape", ["unequal", "identical", "single"])
def test_exact_recurrent_other_shapes(shape: str, family: str) -> None:
    """Rows of unequal length in one step (state taken per row), identical calls, a single chain; one-token
    chunks run the layers' single-step forms from a resident state."""
    loss = LossConfig(entropy_coef=0.01)
    replay = ReplayConfig(microbatch=0, chunk_size=1 if shape == "single" else 4)
    dev, floor = _check(family, torch.float64, shape, loss, replay)
    assert dev.abs <= FACTOR * floor, f"{shape}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize(
    "family", ["qwen3_5_text", "kimi_linear", "jamba", "bamba", "rwkv", *sorted(HYBRID_FAMILIES)]
)
def test_negative_control_recurrent_state_left_out_of_g_is_rejected(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the resident recurrent state detached (its gradient never reaches G; attention KV keeps
    its G) is caught far above the bound, for a Gated DeltaNet, a KDA, a Mamba, a Mamba-2 hybrid and RWKV,
    and for the state part of hybrid layers' entries."""
    import treetrain.models.recurrent_state as recurrent_state

    class Detached:
        @staticmethod
        def apply(x: torch.Tensor, acc: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
            return x.detach()

    monkeypatch.setattr(recurrent_state, "_Into", Detached)
    dev, floor = _check(family, torch.float64, "multi_level", LossConfig(), ReplayConfig(microbatch=2))
    assert dev.abs > 100 * FACTOR * floor, f"{dev.abs:.3e} not far above {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize("family", sorted(HYBRID_FAMILIES))
def test_negative_control_hybrid_kv_left_out_of_g_is_rejected(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV part of a hybrid layer's entry carries gradient too: shared-past attention that reads the
    hybrid layers' resident KV without their G accumulators (their state keeps its G) is caught. The margin
    asked is ten times the bound, not a hundred as elsewhere: in tiny Zamba (no positional encoding, two
    shared-block invocations) the gradient through the past's KV is a small part of the whole."""
    from treetrain.models.shared_past import SharedPast

    layer = SharedPast.layer
    hybrid = hybrid_layers(tiny_model(family, VOCAB))

    def without_g(self: SharedPast, index: int):  # type: ignore[no-untyped-def]
        kv, grads = layer(self, index)
        return kv, (None,) * len(kv) if index in hybrid else grads

    monkeypatch.setattr(SharedPast, "layer", without_g)
    dev, floor = _check(family, torch.float64, "multi_level", LossConfig(), ReplayConfig(microbatch=2))
    assert dev.abs > 10 * FACTOR * floor, f"{dev.abs:.3e} not far above {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize("family", ["qwen3_5_text", "kimi_linear", "zamba2", "rwkv"])
def test_negative_control_response_only_detaches_the_state(family: str) -> None:
    """`response_only` detaches every resident entry, a hybrid layer's KV and state alike."""
    replay = ReplayConfig(contract="response_only", microbatch=2)
    dev, floor = _check(family, torch.float64, "multi_level", LossConfig(), replay)
    assert dev.abs > 1000 * FACTOR * floor


def test_negative_control_state_taken_one_token_early_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Children are fed their parent's last token again, so the state must be the one just before it:
    taking it one token earlier (a token the children never see) is caught."""
    import treetrain.models.decoder as decoder

    capturing = decoder.capturing

    def early(model, cache, lengths):  # type: ignore[no-untyped-def]
        return capturing(model, cache, lengths - 1)

    monkeypatch.setattr(decoder, "capturing", early)
    with pytest.raises(UnsupportedModelError, match="prefix evaluated alone"):  # the split probe sees it too
        check_supported(tiny_model("qwen3_5_text", VOCAB, dtype=torch.float64), 64)
    replay = ReplayConfig(microbatch=1)
    dev, floor = _check("qwen3_5_text", torch.float64, "multi_level", LossConfig(), replay, trusting=True)
    assert dev.abs > 100 * FACTOR * floor, f"{dev.abs:.3e} not far above {FACTOR} x {floor:.3e}"


def test_negative_control_rwkv_shift_taken_after_the_cut_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """RWKV's token shift is part of its state: each mixing module's input before the row's last token.
    Taking the input at the batch's last position instead (what RWKV itself writes into `state`: the row's
    last token, which the children see again, or its padding) is caught by the split probe and, run past
    the probe, by the gradient."""
    import treetrain.models.rwkv_state as rwkv_state

    def last(cache, layer, which, hidden):  # type: ignore[no-untyped-def]
        return hidden[:, -1]

    monkeypatch.setattr(rwkv_state, "_shift_at_cut", last)
    with pytest.raises(UnsupportedModelError, match="continuing from stored KV changes the hidden states"):
        check_supported(tiny_model("rwkv", VOCAB, dtype=torch.float64, attn="eager"), 64)
    replay = ReplayConfig(microbatch=2)
    dev, floor = _check("rwkv", torch.float64, "multi_level", LossConfig(), replay, trusting=True)
    assert dev.abs > 100 * FACTOR * floor, f"{dev.abs:.3e} not far above {FACTOR} x {floor:.3e}"


def _uncut_kind_is_caught(
    monkeypatch: pytest.MonkeyPatch, kind: Kind, uncut: Callable[..., Any], family: str, attn: str
) -> None:
    """Install `kind` with `uncut` as its captured sequence form (the layer's own function, not stopped at
    each row's cut) and check that the split probe refuses the model and that the gradient, run past the
    probe, is far off the flat reference."""
    import sys
    from dataclasses import replace

    import treetrain.models.recurrent_kinds as recurrent_kinds
    import treetrain.models.recurrent_state as recurrent_state

    variant = replace(kind, captured=uncut)
    known = recurrent_kinds.kind_of
    monkeypatch.setattr(recurrent_state, "kind_of", lambda m: variant if variant.matches(m) else known(m))
    model = tiny_model(family, VOCAB, dtype=torch.float64, attn=attn)
    layer, _ = next(iter(mixers(model).values()))
    module = sys.modules[type(layer).__module__]
    for name in variant.functions:  # the layer module's own functions, so the variant is installed instead
        original = recurrent_state._ORIGINAL.get((module.__name__, name), getattr(module, name))
        monkeypatch.setattr(module, name, original)
    with pytest.raises(UnsupportedModelError, match="continuing from stored KV changes the hidden states"):
        check_supported(model, 64)
    replay = ReplayConfig(microbatch=2)
    dev, floor = _check(family, torch.float64, "multi_level", LossConfig(), replay, trusting=True)
    assert dev.abs > 100 * FACTOR * floor, f"{dev.abs:.3e} not far above {FACTOR} x {floor:.3e}"


def test_negative_control_wkv_state_not_stopped_at_the_cut_is_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RWKV's own recurrence in place of the captured one (the WKV state after the whole row, not before its
    last token) is caught by the split probe and, run past the probe, by the gradient."""
    from treetrain.models.recurrent_kinds import WKV

    def uncut(sequence, step):  # type: ignore[no-untyped-def]
        def run(*args, state=None, **kwargs):  # type: ignore[no-untyped-def]
            # its own recurrence, on a copy of the initial state (the model overwrites the tensors it sliced)
            return sequence(*args, state=None if state is None else tuple(s.clone() for s in state), **kwargs)

        return run

    _uncut_kind_is_caught(monkeypatch, WKV, uncut, "rwkv", "eager")


def test_negative_control_kda_state_not_stopped_at_the_cut_is_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KDA's captured sequence form zeroes its per-channel gate and `beta` from each row's cut on, so the
    state stops before the row's last token. The layer's own function in its place (the state after the
    whole row: its last token, which the children see again, and its padding) is caught by the split
    probe and, run past the probe, by the gradient."""
    from treetrain.models.recurrent_kinds import KIMI_DELTA

    def uncut(chunk, step):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: chunk(*args, **{**kwargs, "output_final_state": True})

    _uncut_kind_is_caught(monkeypatch, KIMI_DELTA, uncut, "kimi_linear", "sdpa")


@pytest.mark.parametrize("family", ["qwen3_5_text", pytest.param("zamba2", marks=SLOWEST)])
@pytest.mark.parametrize("contract", ["exact", "response_only"])
def test_recurrent_gradient_unchanged_under_a_retention_budget(contract: str, family: str) -> None:
    """Evicted state is recomputed from the nearest resident ancestor (with the overlap), and the budget
    counts the state's bytes: the tracker never sees more resident bytes than the budget."""
    loss = LossConfig()
    make = factory(family, torch.float64)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    replay = ReplayConfig(contract=contract, microbatch=1, chunk_size=3)

    def run(budget: int | None):  # type: ignore[no-untyped-def]
        model = make()
        model.zero_grad(set_to_none=True)
        tracker = MemoryTracker()
        policy = lay_out(batch, model, loss, replay, retention=budget)
        report = TreeReplay(model, loss, replay, hooks=ReplayHooks(tracker=tracker)).accumulate(
            batch, policy.schedule
        )
        tracker.detach()
        return flat_grad(model), report, policy, tracker

    free, free_report, free_policy, _ = run(None)
    assert free_report.recomputed_units == 0
    floor = noise_floor(make, batch, loss)
    minimum = max(p.minimum for p in free_policy.retention)
    resident = max(p.peak for p in free_policy.retention)
    assert minimum < resident, "the case leaves nothing to evict"
    grad, report, policy, tracker = run(minimum)
    assert report.recomputed_units >= 2, "the smallest budget should force recomputes"
    assert report.recomputed_units == sum(p.recomputes for p in policy.retention)
    assert deviation(grad, free).abs <= FACTOR * floor, "the budget moved the gradient"
    if contract == "exact":
        assert deviation(grad, flat_gradient(make(), batch, loss)).abs <= FACTOR * floor
    assert tracker.class_maxima.prompt_group <= minimum, "resident bytes exceeded the budget"


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_resident_bytes_of_a_unit_are_what_the_ledger_books(family: str) -> None:
    """A unit's stored state (KV of the attention layers, conv and recurrent state of the others) has the
    bytes the ledger and the retention plan price it at, in float64, float32 and bfloat16 (where a state the
    kernels keep in float32 is larger than the model's element size)."""
    for dtype in (*DTYPES.values(), torch.bfloat16):
        model = tiny_model(family, VOCAB, dtype=dtype, attn="eager" if family in EAGER_ONLY else "sdpa")
        tree = SHAPES["multi_level"](0)[0]
        batch = make_batch([tree], LossConfig())
        units = UnitTree.build(tree, batch.work[0].targets, None)
        unit = units[units[0].children[0]]
        padded = pad_pieces([unit.input_tokens], [unit.input_offset], torch.device("cpu"))
        out = decoder_forward(model, padded.input_ids, padded.positions, None, lengths=padded.lengths)
        stored = entry_bytes(own_kv(unit, out, 0))
        per_token, per_unit = kv_bytes_per_token(model), state_bytes_per_unit(model)
        assert per_unit > 0 and (per_token > 0) == (family not in NO_ATTENTION), family
        assert stored == unit_resident_bytes(len(unit), per_token, per_unit), f"{family}/{dtype}"


@pytest.mark.parametrize(
    "family", ["qwen3_5_text", "qwen3_next", "kimi_linear", "jamba", "bamba", *sorted(HYBRID_FAMILIES)]
)
def test_lora_exact_matches_flat_recurrent(family: str) -> None:
    """PEFT adapters on every linear layer, the Gated DeltaNet, KDA and Mamba projections included (and Zamba 2's
    shared block, whose adapters then get the gradient of each layer that runs it)."""
    # PEFT refuses adapters on Falcon-H1's Mamba `out_proj`: every other projection gets one.
    targets = (
        ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "gate_proj", "up_proj", "down_proj")
        if family == "falcon_h1"
        else ("all-linear",)
    )
    make = lora_factory(family, torch.float64, target_modules=targets)
    loss = LossConfig()
    batch = make_batch(SHAPES["multi_level"](0), loss)
    floor = noise_floor(make, batch, loss)
    flat = flat_gradient(make(), batch, loss)
    model = make()
    recurrent = [f".{i}." for i in recurrent_layers(model.get_base_model())]
    wrapped = [
        n for n, _ in model.named_parameters() if "lora_B" in n and any(f"layers{r}" in n for r in recurrent)
    ]
    assert wrapped, "no adapter on the recurrent layers"
    TreeReplay(model, loss, ReplayConfig(microbatch=2, chunk_size=5)).accumulate(batch)
    dev = deviation(flat_grad(model), flat)
    assert float(flat.norm()) > 0
    assert dev.abs <= FACTOR * floor, f"{family}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize("family", ["qwen3_5_text", pytest.param("kimi_linear", marks=SLOWEST), "zamba2"])
@pytest.mark.parametrize("contract", ["exact", "response_only"])
def test_ledger_books_recurrent_state_exactly(contract: str, family: str) -> None:
    """`treetrain plan`'s ledger books the hybrid's resident bytes (KV, conv and recurrent state, and G in
    `exact`) exactly as the tracker measures them, and its whole dynamic peak within the usual 10%
    (tests/memory/test_ledger_recurrent.py has more shapes and the negative control)."""
    from treetrain.memory.ledger import predict_ledger

    loss = LossConfig()
    batch = make_batch(SHAPES["one_level"](0), loss)
    model = tiny_model(family, VOCAB)
    replay = ReplayConfig(contract=contract, microbatch=1)
    ledger = predict_ledger(batch, model, replay, loss)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tracker = MemoryTracker()
    report = TreeReplay(model, loss, replay, hooks=ReplayHooks(tracker=tracker)).accumulate(batch)
    tracker.detach()
    assert report.measured_peak is not None
    resident = max(r.bytes.prompt_group for r in ledger.rows)
    assert resident > 0
    assert resident == tracker.class_maxima.prompt_group, (
        f"booked {resident}, measured {tracker.class_maxima}"
    )
    measured = report.measured_peak.dynamic
    err = (ledger.peak.dynamic - measured) / measured
    assert abs(err) <= 0.10, f"predicted {ledger.peak} vs measured {report.measured_peak}: {err:+.1%}"


def test_hybrid_attention_layers_read_resident_pieces_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hybrids' attention layers take shared-past attention (no concatenated, broadcast past), found
    from their source since their classes leave `_supports_attention_backend` unset; a class whose
    attention does not look its function up keeps the concatenated path, with the reason."""
    import treetrain.models.attention as attention

    model = tiny_model("qwen3_5_text", VOCAB, dtype=torch.float64)
    assert not getattr(model, "_supports_attention_backend", False)
    assert attention.shared_past_reason(model) is None
    calls: list[int] = []
    attend = attention.shared_attention

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return attend(*args, **kw)

    monkeypatch.setattr(attention, "shared_attention", spy)
    loss = LossConfig()
    batch = make_batch(SHAPES["one_level"](0), loss)
    TreeReplay(model, loss, ReplayConfig(microbatch=2)).accumulate(batch)
    assert calls, "no attention layer read the resident pieces in place"
    monkeypatch.setattr(attention, "_reads_interface", lambda cls: False)
    reason = attention.shared_past_reason(model)
    assert reason is not None and "attention interface" in reason


def test_zamba2_shared_block_attends_over_each_layers_own_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Zamba 2's shared transformer block is one module (`layer_idx = -1`) run by every hybrid layer, each
    with its own KV: shared-past attention reads the pieces of the layer running it (the cache index its KV
    was just written at), in place. Reading one layer's KV for every invocation is refused by the split
    probe."""
    import treetrain.models.attention as attention

    model = tiny_model("zamba2", VOCAB, dtype=torch.float64)
    hybrid = hybrid_layers(model)
    assert len(hybrid) >= 2 and attention.shared_past_reason(model) is None
    read: list[int] = []
    source = attention.kv_source_layer

    def spy(module):  # type: ignore[no-untyped-def]
        read.append(source(module))
        return read[-1]

    monkeypatch.setattr(attention, "kv_source_layer", spy)
    loss = LossConfig()
    TreeReplay(model, loss, ReplayConfig(microbatch=2)).accumulate(make_batch(SHAPES["one_level"](0), loss))
    assert set(read) == hybrid, f"shared-past attention read layers {sorted(set(read))}, not {sorted(hybrid)}"
    first = min(hybrid)
    monkeypatch.setattr(attention, "attending_layer", lambda: first)
    with pytest.raises(UnsupportedModelError, match="shared-past attention over resident KV changes"):
        check_supported(tiny_model("zamba2", VOCAB, dtype=torch.float64), 64)


def test_resident_store_keeps_both_parts_of_a_hybrid_entry() -> None:
    """A hybrid layer's entry is stored, sized, offloaded, restored and given G part by part: its KV and
    its state. A store that dropped the state part would book fewer bytes and restore a pair."""
    from treetrain.models.layer_entry import HybridEntry, entry_tensors
    from treetrain.replay.resident import ResidentIdentity, ResidentKey, ResidentStore

    model = tiny_model("zamba2", VOCAB)
    identity = ResidentIdentity.of(model)
    store = ResidentStore(identity)
    key = ResidentKey("tree", 1, "node")
    gen = torch.Generator().manual_seed(0)
    kv = (torch.randn(1, 2, 5, 16, generator=gen), torch.randn(1, 2, 5, 16, generator=gen))  # [1, H_kv, P, D]
    state = (torch.randn(1, 80, 3, generator=gen), torch.randn(1, 4, 16, 8, generator=gen))  # conv, SSM state
    mamba = (torch.randn(1, 80, 3, generator=gen), torch.randn(1, 4, 16, 8, generator=gen))
    entries = [mamba, HybridEntry(kv, state)]
    store.put(key, entries, identity)
    assert store.kv_bytes == entry_bytes(entries) > entry_bytes([mamba, kv])
    store.offload(key)
    assert store.kv_bytes == 0 and store.has_host(key)
    store.restore(key, identity, torch.device("cpu"))
    back = store.get(key, identity)
    assert isinstance(back[1], HybridEntry) and not isinstance(back[0], HybridEntry)
    assert all(torch.equal(a, b) for a, b in zip(entry_tensors(back[1]), entry_tensors(entries[1])))
    grads = store.grad_buffers(key, back, identity)
    assert isinstance(grads[1], HybridEntry) and store.grad_bytes == entry_bytes(entries)
    store.add_grad(key, entries, identity)
    assert all(torch.equal(g, t) for g, t in zip(entry_tensors(grads[1]), entry_tensors(entries[1])))
    assert len(store.tensors_of(key)) == 2 * (2 + 4)
