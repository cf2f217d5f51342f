"""Sliding windows that a layer takes only from its model's mask (PhiMoE, Doge: their attention passes no
`sliding_window` to the attention function; the model builds a sliding-window mask for every layer).

Shared-past attention never uses Hugging Face's mask, so it reads the window off the mask the model asked
for (`treetrain.models.attention._no_mask`). Differential against the flat reference at the measured noise
floor, with a window shorter than the shared prefix, and a negative control: the window dropped, the
support check refuses it and the tree gradient leaves the floor by orders of magnitude."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from support.replay_cases import SHAPES, VOCAB, make_batch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

import treetrain.models.attention as attention
from treetrain.loss.loss_config import LossConfig
from treetrain.models.attention import shared_past_reason
from treetrain.models.support import SupportGate, UnsupportedModelError, check_supported
from treetrain.replay import ReplayConfig
from treetrain.replay.tree_replay import TreeReplay
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor

WINDOW = 10  # shorter than the shared 16-token prompt of the multi-level trees


def _factory(family: str) -> Callable[[], PreTrainedModel]:
    config = AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip

    def make() -> PreTrainedModel:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa", dtype=torch.float64, experts_implementation="eager"
            )
            with torch.no_grad():  # Doge's per-key mask bias is exp(A * softplus(dt)): A = 0 at init is flat
                for module in model.modules():
                    if isinstance(getattr(module, "A", None), torch.nn.Parameter):
                        module.A.normal_(0.0, 2.0)
            # eval: in train mode PhiMoE's router (sparsemixer) draws its gradient estimator at random,
            # which no two runs, flat or tree, share
            return model.eval()

    return make


def _floor(family: str) -> float:
    """The noise floor of the tree gradient (`treetrain.replay.verify.noise_floor`), measured unpatched."""
    loss = LossConfig()
    return noise_floor(_factory(family), make_batch(SHAPES["multi_level"](0), loss), loss)


def _deviation(family: str, *, check_model: bool = True) -> float:
    """The tree gradient's deviation from the flat one; the support check runs first unless `check_model`
    is off (the negative controls' second half)."""
    loss = LossConfig()
    make = _factory(family)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    model = make()
    TreeReplay(
        model, loss, ReplayConfig(microbatch=2), support=SupportGate(trusting=not check_model)
    ).accumulate(batch)
    return deviation(flat_grad(model), flat_gradient(make(), batch, loss)).abs


def test_phimoe_attends_over_its_past_with_the_window_of_its_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    windows: list[int | None] = []
    real = attention.shared_attention

    def recording(*args: Any, **kwargs: Any) -> Any:
        windows.append(args[6].window)  # the ScoreForm
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "shared_attention", recording)
    floor = _floor("phimoe")
    dev = _deviation("phimoe")
    assert windows and set(windows) == {WINDOW}, "phimoe did not attend over its past with its window"
    assert dev <= 5.0 * floor


def test_negative_control_phimoe_without_the_mask_window_is_refused_and_its_gradient_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    floor = _floor("phimoe")
    monkeypatch.setattr(attention, "_mask_window", lambda: None)
    with pytest.raises(UnsupportedModelError, match="sliding window of 10 tokens"):
        check_supported(_factory("phimoe")(), 64)
    bad = _deviation("phimoe", check_model=False)
    assert bad > 100 * 5.0 * floor


def test_doge_and_its_dynamic_mask_take_the_concatenated_past() -> None:
    """Doge adds a learned bias per key through the mask it builds itself; over the concatenated past the
    layer builds it over every key, window included, as in the flat forward."""
    floor = _floor("doge")
    dev = _deviation("doge")
    assert shared_past_reason(_factory("doge")()) == attention.OWN_MASK
    assert dev <= 5.0 * floor


def test_negative_control_doge_through_shared_past_attention_without_its_mask_is_refused_and_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    floor = _floor("doge")
    real = cast(Callable[..., Any], AttentionInterface._global_mapping[attention.SHARED])

    def maskless(*args: Any, **kwargs: Any) -> Any:
        if "attention_mask" in kwargs:
            return real(*args, **{**kwargs, "attention_mask": None})
        return real(*args[:4], None, *args[5:], **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, attention.SHARED, maskless)
    monkeypatch.setattr(attention, "_LAYOUT_MISMATCH", {})
    with pytest.raises(UnsupportedModelError, match="changes the hidden states"):
        check_supported(_factory("doge")(), 64)
    bad = _deviation("doge", check_model=False)
    assert bad > 100 * 5.0 * floor


def test_only_a_sliding_window_mask_gives_its_window_and_a_chunked_one_does_not() -> None:
    """A chunked mask passes its chunk size to the mask call as a sliding one passes its window; taking
    it for a window would attend across chunks."""
    pad = torch.zeros(1, dtype=torch.long)
    cases = [
        (sliding_window_causal_mask_function(4), 4),
        (chunked_causal_mask_function(4, pad), None),  # the negative control
    ]
    for mask_function, expected in cases:
        token = attention._MASKS.set(())
        try:
            attention._no_mask(local_size=4, mask_function=mask_function)
            assert attention._mask_window() == expected
        finally:
            attention._MASKS.reset(token)
