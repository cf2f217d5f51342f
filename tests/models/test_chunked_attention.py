"""Chunked attention (Llama 4's `attention_chunk_size`) through the resident past: a query at absolute
position i sees the keys j <= i of its own chunk, j // C == i // C.

Hugging Face applies the chunk only through the chunked mask its model builds for the chunked layers, and
shared-past attention never uses that mask, so it takes the chunk from the layer's type
(`treetrain.models.attention.layer_chunk`) and restricts each resident piece to the keys of the query's
chunk, from absolute positions, as a window restricts them to the window. Llama 4's NoPE layers scale
their queries by a temperature that grows with the position read off the cache; the cache of a
shared-past forward reports the past's length (`PastLengthCache`), so the tiny model's floor scale of 2
makes that scale change within the tests. Differential against plain attention over the concatenated past
and against the flat reference at its measured noise floor, in float64, with negative controls: the chunk
dropped, and the past's length left out of the cache."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.attention_oracle import reference
from support.replay_cases import SHAPES, make_batch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

import treetrain.models.attention as attention
import treetrain.models.attention_states as attention_states
import treetrain.models.decoder as decoder
from treetrain.loss.loss_config import LossConfig
from treetrain.models.shared_past import ScoreForm, shared_attention
from treetrain.models.support import SupportGate, UnsupportedModelError, check_supported
from treetrain.models.tiny_family import SHORT, tiny_family_config
from treetrain.replay import ReplayConfig
from treetrain.replay.tree_replay import TreeReplay
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize(("chunk", "window"), [(4, None), (7, None), (7, 5)])
def test_chunked_shared_attention_equals_plain_attention_over_the_concatenated_past(
    backend: str, chunk: int, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces of 9, 1 and 13 keys, and 5 own tokens at positions 23..27: a chunk of 4 splits the own tokens,
    one of 7 cuts the last piece and hides the first two; with a window as well, the stricter bound wins."""
    monkeypatch.setattr(attention_states, "FUSED_CPU", backend == "fused")
    gen = torch.Generator().manual_seed(chunk)
    rows, heads, kv_heads, t, d, lengths = 3, 4, 2, 5, 8, (9, 1, 13)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, k_own, v_own = rand(rows, heads, t, d), rand(rows, kv_heads, t, d), rand(rows, kv_heads, t, d)
    past = [(rand(1, kv_heads, n, d), rand(1, kv_heads, n, d)) for n in lengths]
    positions = torch.arange(sum(lengths), sum(lengths) + t).expand(rows, -1)
    inputs = [q, k_own, v_own, *(x for kv in past for x in kv)]
    out = shared_attention(q, k_own, v_own, positions, past, (), ScoreForm(d**-0.5, window, chunk=chunk))
    ref = reference(q, k_own, v_own, positions, past, window, chunk)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    tol = 1e-12  # a few float64 ulps at these magnitudes (SDPA sums in another order)
    assert (out - ref).abs().max() <= tol
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= tol * max(1.0, float(r.abs().max()))
    # The negative control: the same call without its chunk attends across chunks.
    unchunked = shared_attention(q, k_own, v_own, positions, past, (), ScoreForm(d**-0.5, window))
    assert (unchunked - ref).abs().max() > 1e6 * tol


def _make() -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(
            tiny_family_config("llama4_text"), attn_implementation="sdpa", dtype=torch.float64,
            experts_implementation="eager",
        )  # fmt: skip
        return model.eval()


@functools.cache
def _floor() -> float:
    """The noise floor of the tree gradient (`treetrain.replay.verify.noise_floor`), measured unpatched."""
    loss = LossConfig()
    return noise_floor(_make, make_batch(SHAPES["multi_level"](0), loss), loss)


def _deviation(*, check_model: bool = True) -> float:
    """The tree gradient's deviation from the flat one over the multi-level trees (a 16-token shared
    prompt, so chunks of 6 cross pieces); the support check runs first unless `check_model` is off."""
    loss = LossConfig()
    batch = make_batch(SHAPES["multi_level"](0), loss)
    model = _make()
    TreeReplay(
        model, loss, ReplayConfig(microbatch=2), support=SupportGate(trusting=not check_model)
    ).accumulate(batch)
    return deviation(flat_grad(model), flat_gradient(_make(), batch, loss)).abs


def test_llama4_attends_over_its_past_in_chunks_at_the_noise_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    chunks: list[int | None] = []
    real: Callable[..., Any] = attention.shared_attention

    def recording(*args: Any, **kwargs: Any) -> Any:
        chunks.append(args[6].chunk)  # the ScoreForm
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "shared_attention", recording)
    model = _make()
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    assert model.config.attention_chunk_size == SHORT
    check_supported(model, 64)
    floor = _floor()
    dev = _deviation()
    assert set(chunks) == {SHORT, None}, "llama4's chunked layer did not attend over its past in chunks"
    assert dev <= 5.0 * floor


def test_negative_control_llama4_without_its_chunk_is_refused_and_its_gradient_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    floor = _floor()
    monkeypatch.setattr(attention, "layer_chunk", lambda module: None)
    with pytest.raises(UnsupportedModelError, match=f"attention chunks of {SHORT} tokens"):
        check_supported(_make(), 64)
    bad = _deviation(check_model=False)
    assert bad > 100 * 5.0 * floor


def test_negative_control_a_cache_without_the_past_length_moves_the_nope_layers_temperature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    floor = _floor()
    monkeypatch.setattr(decoder.PastLengthCache, "get_seq_length", DynamicCache.get_seq_length)
    with pytest.raises(UnsupportedModelError, match="changes the hidden states"):
        check_supported(_make(), 64)
    bad = _deviation(check_model=False)
    assert bad > 100 * 5.0 * floor
