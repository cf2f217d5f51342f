"""Indexed sparse attention (DeepSeek V3.2, GLM-5, AXK2) through the resident past: each query attends to
the `index_topk` earlier positions its indexer scores highest, past and own together.

A unit keeps its indexer's keys beside its MLA latents (`IndexedEntry`); a forward continuing a past puts
them into the cache ahead of the rows' own (`treetrain.models.indexer_state.indexed_cache`), and the model's
own indexer and attention run over the whole. The tiny configs select 4 of up to 30 positions, so the
selection matters; GLM-5's has a layer that reuses the previous layer's selection. Differential, in float64:
the engine's logprobs continuing a past split in three against the model's own forward, and the tree
gradient against the flat reference at its measured noise floor. Negative control: the past's indexer keys
zeroed in the cache (its KV intact), which the support check refuses and the gradient check catches."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from support.replay_cases import SHAPES, make_batch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

import treetrain.models.indexer_state as indexer_state
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.persistent import kv_bytes_per_token
from treetrain.models.decoder import IndexedEntry, LayerEntry, decoder_forward, output_head
from treetrain.models.indexer_state import index_key_bytes_per_token, indexed_layers
from treetrain.models.layer_entry import entry_tensors, grad_zeros, map_entry
from treetrain.models.shared_past import SharedPast
from treetrain.models.support import SupportGate, UnsupportedModelError, check_supported
from treetrain.models.tiny_family import tiny_family_config
from treetrain.replay import ReplayConfig
from treetrain.replay.tree_replay import TreeReplay
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor

FAMILIES = ("deepseek_v32", "glm_moe_dsa", "axk2")
FACTOR = 5.0


def _make(family: str) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(
            tiny_family_config(family), attn_implementation="sdpa", dtype=torch.float64,
            experts_implementation="eager",
        )  # fmt: skip
        return model.eval()


@functools.cache
def _floor(family: str) -> float:
    """The noise floor of the tree gradient (`treetrain.replay.verify.noise_floor`), measured unpatched."""
    loss = LossConfig()
    return noise_floor(lambda: _make(family), make_batch(SHAPES["multi_level"](0), loss), loss)


def _deviation(family: str, *, check_model: bool = True) -> float:
    """The tree gradient's deviation from the flat one over the multi-level trees (a 16-token shared prompt,
    several levels, K = 2); the support check runs first unless `check_model` is off."""
    loss = LossConfig()
    batch = make_batch(SHAPES["multi_level"](0), loss)
    model = _make(family)
    TreeReplay(
        model, loss, ReplayConfig(microbatch=2), support=SupportGate(trusting=not check_model)
    ).accumulate(batch)
    return deviation(flat_grad(model), flat_gradient(_make(family), batch, loss)).abs


def _zeroed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the cache receives the past's indexer keys as zeros (its KV stays intact)."""
    real = indexer_state.indexed_cache

    def zeroed(model: Any, n: int, past: Sequence[Sequence[LayerEntry]] | None, rows: int) -> DynamicCache:
        blank = [
            [map_entry(torch.zeros_like, e) if isinstance(e, IndexedEntry) else e for e in p]
            for p in past or ()
        ]
        return real(model, n, blank or None, rows)

    monkeypatch.setattr(indexer_state, "indexed_cache", zeroed)


def _split_logprob_error(model: PreTrainedModel, cuts: tuple[int, ...] = (9, 17)) -> float:
    """Max |logprob| difference of the engine continuing a past of two pieces (`cuts`) against the model's
    own forward over 30 tokens."""
    ids = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(30)[None]
    with torch.no_grad():
        own = model(input_ids=ids, position_ids=pos, use_cache=False).logits.log_softmax(-1)  # [1, 30, V]
        pieces: list[list[LayerEntry]] = []
        hidden = []
        for a, b in zip((0, *cuts), (*cuts, 30)):
            out = decoder_forward(model, ids[:, a:b], pos[:, a:b], SharedPast.of(pieces) if pieces else None)
            hidden.append(out.hidden)
            pieces.append([out.entry(i) for i in range(len(out.keys))])
        engine = output_head(model)(torch.cat(hidden, 1)).log_softmax(-1)
    return float((engine - own).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_indexed_attention_selects_over_the_resident_past_at_the_noise_floor(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _make(family)
    assert set(model.config.layer_types) == {"indexed_attention"}
    assert model.config.index_topk == 4
    check_supported(model, 64)
    assert _split_logprob_error(model) <= 1e-6  # the float32 islands (RMSNorm, the indexer's scores)
    widest: list[int] = []  # per indexer call, the most positions a query could choose from
    past_lengths: list[int] = []
    real = indexer_state.indexed_cache

    def spy(model: Any, n: int, past: Any, rows: int) -> DynamicCache:
        cache = real(model, n, past, rows)
        held = (getattr(layer, "indexer_keys", None) for layer in cache.layers)
        past_lengths.extend(int(k.shape[1]) for k in held if k is not None)
        return cache

    monkeypatch.setattr(indexer_state, "indexed_cache", spy)
    handles = [
        m.register_forward_hook(lambda mod, args, out: widest.append(int(args[3].shape[-1])))
        for m in model.modules()
        if type(m).__name__.endswith("Indexer")
    ]
    floor = _floor(family)
    loss = LossConfig()
    batch = make_batch(SHAPES["multi_level"](0), loss)
    TreeReplay(model, loss, ReplayConfig(microbatch=2)).accumulate(batch)
    for h in handles:
        h.remove()
    dev = deviation(flat_grad(model), flat_gradient(_make(family), batch, loss)).abs
    assert past_lengths and max(past_lengths) >= 16, "no forward continued a resident past's indexer keys"
    assert max(widest) > 4 * model.config.index_topk, "the indexer never had to choose"
    assert dev <= FACTOR * floor, f"{family}: |tree - flat| = {dev:.3e} > {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_zeroed_resident_indexer_keys_are_refused_and_their_gradient_is_off(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    floor = _floor(family)
    _zeroed(monkeypatch)
    assert _split_logprob_error(_make(family)) > 1e-3
    with pytest.raises(UnsupportedModelError, match="continuing from stored KV changes the hidden states"):
        check_supported(_make(family), 64)
    bad = _deviation(family, check_model=False)
    assert bad > 100 * FACTOR * floor, f"{family}: {bad:.3e} not far above {FACTOR} x {floor:.3e}"


def test_qwen4_exp_qsa_indexer_is_refused_with_its_reason() -> None:
    model = AutoModelForCausalLM.from_config(tiny_family_config("qwen4_exp_text"), attn_implementation="sdpa")
    with pytest.raises(UnsupportedModelError, match="QSA"):
        check_supported(model, 64)


@pytest.mark.parametrize("family", FAMILIES)
def test_resident_bytes_per_token_count_the_indexer_keys(family: str) -> None:
    """The planner's per-token size against what a unit keeps resident: latents and indexer keys."""
    model = _make(family)
    with torch.no_grad():
        out = decoder_forward(model, torch.arange(1, 6)[None], torch.arange(5)[None], None)
    entries = [out.entry(i) for i in range(len(out.keys))]
    held = sum(t.numel() * t.element_size() for e in entries for t in entry_tensors(e)) // 5
    index_keys = index_key_bytes_per_token(model)
    assert sum(isinstance(e, IndexedEntry) for e in entries) == len(indexed_layers(model)) >= 2
    assert index_keys == len(indexed_layers(model)) * model.config.index_head_dim * 8
    assert kv_bytes_per_token(model) == held
    # and G, which the indexer keys take none of, is the KV part only
    assert all(not isinstance(grad_zeros(e), IndexedEntry) for e in entries)
