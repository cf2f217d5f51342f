"""The engine's attention against resident KV: shared-past attention equals plain attention over the
concatenated past, never materialises that past per row or per head, and routes dL/dKV into G.

The engine-level differential tests (tests/replay/test_replay_exact.py, every family, `sdpa` and `eager`, K, order,
chunking, budget and dtype against the flat oracle) run through shared-past attention; here the kernel
itself is checked (with and without attention sinks), gpt-oss (eager, sinks, a window) against flat, and
negative controls show the engine check catches a wrong log-sum-exp merge and a dropped sink.
"""

from __future__ import annotations

import pytest
import torch
from support.attention_oracle import reference, reference_eager, reference_with_sinks
from support.replay_cases import SHAPES, VOCAB, factory, make_batch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import treetrain.models.attention as attention
import treetrain.models.attention_states as attention_states
import treetrain.models.decoder as decoder
import treetrain.models.shared_past as shared_past
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.replay_layout import lay_out
from treetrain.models.attention import NAME, engine_attention, shared_past_kernel_note, shared_past_reason
from treetrain.models.decoder import SharedPast, decoder_forward
from treetrain.models.presets import TinySize, tiny_model
from treetrain.models.shared_past import ScoreForm, shared_attention
from treetrain.models.support import SupportGate, UnsupportedModelError
from treetrain.replay import ReplayConfig
from treetrain.replay.tree_replay import TreeReplay
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor

SIZE = TinySize(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=64)
PAST, NEW = 40, 6


class _Shapes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window", [None, 7, 30])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_shared_attention_equals_plain_attention_over_the_concatenated_past(
    backend: str, dtype: torch.dtype, window: int | None, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention_states, "FUSED_CPU", backend == "fused")
    monkeypatch.setattr(attention_states, "BLOCK_ELEMENTS", 64 * 8)  # several key blocks per piece
    gen = torch.Generator().manual_seed(kv_heads)
    rows, heads, t, d, lengths = 3, 4, 5, 8, (9, 1, 70)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    q, k_own, v_own = rand(rows, heads, t, d), rand(rows, kv_heads, t, d), rand(rows, kv_heads, t, d)
    past = [(rand(1, kv_heads, n, d), rand(1, kv_heads, n, d)) for n in lengths]
    positions = torch.arange(sum(lengths), sum(lengths) + t).expand(rows, -1)
    inputs = [q, k_own, v_own, *(x for kv in past for x in kv)]
    out = shared_attention(q, k_own, v_own, positions, past, (), ScoreForm(d**-0.5, window))
    ref = reference(q, k_own, v_own, positions, past, window)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    # Tolerance: a few ulps of the dtype at these magnitudes (SDPA sums in another order).
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert (out - ref).abs().max() <= tol
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= tol * max(1.0, float(r.abs().max()))

    # Into G accumulators instead: the pieces' gradients arrive there once, summed over the rows.
    frozen = [(k.detach(), v.detach()) for k, v in past]
    acc = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in frozen]
    out2 = shared_attention(q, k_own, v_own, positions, frozen, acc, ScoreForm(d**-0.5, window))
    (out2 * weight).sum().backward()
    for (gk, gv), i in zip(acc, range(3, len(grads), 2)):
        assert torch.equal(gk, grads[i]) and torch.equal(gv, grads[i + 1])


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_sinks_enter_the_merge_as_one_more_logit(
    backend: str, window: int | None, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention_states, "FUSED_CPU", backend == "fused")
    gen = torch.Generator().manual_seed(10 + kv_heads)
    rows, heads, t, d, lengths = 2, 4, 5, 8, (9, 30)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()

    q, k_own, v_own = rand(rows, heads, t, d), rand(rows, kv_heads, t, d), rand(rows, kv_heads, t, d)
    sinks = rand(heads, scale=3.0)  # large enough that a dropped sink changes every output
    past = [(rand(1, kv_heads, n, d), rand(1, kv_heads, n, d)) for n in lengths]
    positions = torch.arange(sum(lengths), sum(lengths) + t).expand(rows, -1)
    inputs = [q, k_own, v_own, sinks, *(x for kv in past for x in kv)]
    out = shared_attention(q, k_own, v_own, positions, past, (), ScoreForm(d**-0.5, window), sinks=sinks)
    ref = reference_with_sinks(q, k_own, v_own, positions, past, window, sinks)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    assert (out - ref).abs().max() <= 1e-12
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= 1e-12 * max(1.0, float(r.abs().max()))
    # The control: without the sink term the kernel is far off.
    plain = shared_attention(q, k_own, v_own, positions, past, (), ScoreForm(d**-0.5, window))
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize(("value_head", "softcap"), [(4, None), (12, None), (8, 0.7), (4, 0.7)])
@pytest.mark.parametrize("window", [None, 7])
def test_a_value_head_of_another_size_and_soft_capped_scores(
    backend: str, value_head: int, softcap: float | None, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLA's value head is smaller than its query/key head (the fused kernels need one size: padded, then
    sliced); Gemma 2 caps every score (`cap * tanh(s / cap)`: the reference kernel). Forward and every
    gradient against eager attention over the concatenated past."""
    monkeypatch.setattr(attention_states, "FUSED_CPU", backend == "fused")
    monkeypatch.setattr(attention_states, "BLOCK_ELEMENTS", 64 * 8)
    gen = torch.Generator().manual_seed(value_head)
    rows, heads, kv_heads, t, d, lengths = 3, 4, 2, 5, 8, (9, 1, 30)

    def rand(*shape: int) -> torch.Tensor:
        return (2.0 * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()

    q, k_own, v_own = rand(rows, heads, t, d), rand(rows, kv_heads, t, d), rand(rows, kv_heads, t, value_head)
    past = [(rand(1, kv_heads, n, d), rand(1, kv_heads, n, value_head)) for n in lengths]
    positions = torch.arange(sum(lengths), sum(lengths) + t).expand(rows, -1)
    inputs = [q, k_own, v_own, *(x for kv in past for x in kv)]
    out = shared_attention(q, k_own, v_own, positions, past, (), ScoreForm(d**-0.5, window, softcap))
    ref = reference_eager(q, k_own, v_own, positions, past, window, softcap)
    assert out.shape == (rows, t, heads, value_head)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    assert (out - ref).abs().max() <= 1e-12
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= 1e-12 * max(1.0, float(r.abs().max()))
    if softcap is not None:  # the control: the same scores uncapped are far off (the scores reach the cap)
        uncapped = shared_attention(q, k_own, v_own, positions, past, (), ScoreForm(d**-0.5, window))
        assert (uncapped - ref).abs().max() > 1e-2


def _decoder_run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, ...]]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, PAST + NEW), generator=gen)
    pos = torch.arange(PAST + NEW)[None].expand(2, -1)
    with torch.no_grad():
        first = decoder_forward(model, ids[:1, :PAST], pos[:1, :PAST], None)
    past = [(k.detach(), v.detach()) for k, v in zip(first.keys, first.values)]
    acc = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in past]
    with _Shapes() as probe:
        out = decoder_forward(model, ids[:, PAST:], pos[:, PAST:], SharedPast.of([past], [acc]))
        out.hidden.square().sum().backward()
    return out.hidden.detach(), acc[0][0].clone(), probe.shapes


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_past_is_never_concatenated_broadcast_or_expanded(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(family, 64, size=SIZE, dtype=torch.float64)
    hidden, grad, shapes = _decoder_run(model)
    assert model.config._attn_implementation == "sdpa"  # restored after every forward
    d = model.config.head_dim
    whole = [
        (2, SIZE.num_heads, PAST + NEW, d),
        (2, 1, PAST + NEW, d),
        (2, 1, PAST, d),
        (2, SIZE.num_heads, PAST, d),
    ]
    assert not [s for s in shapes if s in whole], "the past was materialised per row or per head"
    assert float(grad.abs().sum()) > 0, "no gradient reached the G accumulator"

    monkeypatch.setattr(decoder, "shared_past_reason", lambda m: "control")
    ref_hidden, ref_grad, ref_shapes = _decoder_run(model)
    assert [s for s in ref_shapes if s in whole]  # the control: the concatenated path does materialise it
    assert torch.allclose(hidden, ref_hidden, rtol=0, atol=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-12)


def test_attention_that_does_not_decompose_keeps_the_concatenated_path() -> None:
    assert shared_past_reason(tiny_model("llama", 64, size=SIZE)) is None
    assert shared_past_reason(tiny_model("llama", 64, size=SIZE, attn="eager")) is None
    other = tiny_model("llama", 64, size=SIZE)
    other.config._attn_implementation = "flash_attention_2"  # not run: only the reason is read
    reason = shared_past_reason(other)
    assert reason is not None and "flash_attention_2" in reason
    capped = tiny_model("llama", 64, size=SIZE)
    capped.config.attn_logit_softcapping = 50.0  # decomposed, on the reference kernel
    assert shared_past_reason(capped) is None and shared_past_kernel_note(tiny_model("llama", 64)) is None
    assert "soft-capping" in str(shared_past_kernel_note(capped))
    eager = tiny_model("llama", 64, size=SIZE, attn="eager")
    with engine_attention(eager):
        assert eager.config._attn_implementation == "eager"
    sdpa = tiny_model("llama", 64, size=SIZE)
    with pytest.raises(RuntimeError), engine_attention(sdpa):
        assert sdpa.config._attn_implementation == NAME
        raise RuntimeError("a failing forward")
    assert sdpa.config._attn_implementation == "sdpa"


def _gpt_oss(seed: int = 0) -> PreTrainedModel:
    """A tiny gpt-oss (eager attention, learned sinks, GQA, a 12-token window on every other layer)."""
    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=12, max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float64, experts_implementation="eager"
        )
        with torch.no_grad():  # sinks large enough to matter (the init draws them near zero)
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _gpt_oss_vs_flat(check_model: bool = True) -> tuple[float, float]:
    loss = LossConfig()
    batch = make_batch(SHAPES["multi_level"](0), loss)
    floor = noise_floor(_gpt_oss, batch, loss)
    model = _gpt_oss()
    TreeReplay(
        model, loss, ReplayConfig(microbatch=2), support=SupportGate(trusting=not check_model)
    ).accumulate(batch)
    return deviation(flat_grad(model), flat_gradient(_gpt_oss(), batch, loss)).abs, floor


def test_eager_gpt_oss_with_sinks_takes_shared_past_attention_and_matches_flat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert shared_past_reason(_gpt_oss()) is None
    calls = []
    real = attention.shared_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("sinks"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "shared_attention", counting)
    dev, floor = _gpt_oss_vs_flat()
    assert calls and all(s is not None for s in calls), "gpt-oss did not run shared-past attention with sinks"
    assert dev <= 5.0 * floor

    def sinkless(*args, **kwargs):  # the negative control: the sink term left out of the merge
        return real(*args, **{**kwargs, "sinks": None})

    monkeypatch.setattr(attention, "shared_attention", sinkless)
    with pytest.raises(UnsupportedModelError):  # the model probe's split-versus-whole check refuses it
        _gpt_oss_vs_flat()
    bad, bad_floor = _gpt_oss_vs_flat(check_model=False)  # and the differential check catches it
    assert bad > 100 * 5.0 * bad_floor


def test_gpt_oss_matches_flat_across_k_order_chunking_and_budget() -> None:
    """Sinks, a window and GQA through shared-past attention, under the ways the engine splits the work."""
    loss = LossConfig()
    batch = make_batch(SHAPES["multi_level"](0), loss)
    floor = noise_floor(_gpt_oss, batch, loss)
    flat = flat_gradient(_gpt_oss(), batch, loss)
    bounded = ReplayConfig(microbatch=1, chunk_size=6, order="reverse")
    model = _gpt_oss()
    free = lay_out(batch, model, loss, bounded)
    TreeReplay(model, loss, bounded).accumulate(batch, free.schedule)
    cases = [
        (ReplayConfig(microbatch=0, order="shuffle", seed=4), None),
        (bounded, max(p.minimum for p in free.retention)),  # the smallest feasible budget: recomputes
    ]
    for replay, budget in cases:
        model = _gpt_oss()
        schedule = lay_out(batch, model, loss, replay, retention=budget).schedule
        report = TreeReplay(model, loss, replay).accumulate(batch, schedule)
        assert budget is None or report.recomputed_units > 0
        dev = deviation(flat_grad(model), flat).abs
        assert dev <= 5.0 * floor, f"{replay}, budget {budget}: {dev:.3e} > 5 x {floor:.3e}"


def _exact_vs_flat(*, trusting: bool = False) -> tuple[float, float]:
    """(|exact - flat|, noise floor) on mistral; `trusting` runs the engine past the support probe."""
    loss = LossConfig()
    make = factory("mistral", torch.float64)  # GQA and an active sliding window
    batch = make_batch(SHAPES["multi_level"](0), loss)
    floor = noise_floor(make, batch, loss)
    model = make()
    model.zero_grad(set_to_none=True)
    gate = SupportGate(trusting=trusting)
    TreeReplay(model, loss, ReplayConfig(microbatch=2), support=gate).accumulate(batch)
    return deviation(flat_grad(model), flat_gradient(make(), batch, loss)).abs, floor


def test_engine_runs_shared_past_attention_and_a_wrong_merge_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    real = attention.shared_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "shared_attention", counting)
    dev, floor = _exact_vs_flat()
    assert calls, "the engine never ran shared-past attention"
    assert dev <= 5.0 * floor

    merge = shared_past.merge_into

    def wrong_merge(out_a, lse_a, out_b, lse_b):  # keeps the larger log-sum-exp instead of their log-add
        out, _ = merge(out_a, lse_a, out_b, lse_b)
        return out, torch.maximum(lse_a, lse_b)

    monkeypatch.setattr(shared_past, "merge_into", wrong_merge)
    with pytest.raises(UnsupportedModelError, match="recomputed from stored state"):
        _exact_vs_flat()  # the probe's chain of three key sets sees it first
    bad, bad_floor = _exact_vs_flat(trusting=True)
    assert bad > 100 * 5.0 * bad_floor
