"""The model-support check: exactness checked by behaviour as well as by name, every refusal reason true,
and a probe that fails for any reason is a refusal naming the model type and the step."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import treetrain.models.attention as attention
import treetrain.models.logit_head as logit_head
import treetrain.models.support_probes as support_probes
from treetrain.models.attention import shared_past_reason
from treetrain.models.foreign_state import forward_state_reason, module_state_reason
from treetrain.models.presets import EAGER_ONLY, tiny_model
from treetrain.models.support import UnsupportedModelError, check_supported
from treetrain.models.support_table import MAX_PARAMETERS, support_row
from treetrain.models.tiny_family import tiny_family_config

VOCAB = 64
SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
)


def _model(kind: str, **kw: Any) -> PreTrainedModel:
    config = AutoConfig.for_model(kind, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model


def _starcoder2(residual_dropout: float) -> PreTrainedModel:
    return _model(
        "starcoder2", **SMALL, num_hidden_layers=2, residual_dropout=residual_dropout, embedding_dropout=0.0,
        attention_dropout=0.0, sliding_window=None,
    )  # fmt: skip


def test_a_config_dropout_field_read_by_functional_dropout_is_refused_in_train_mode() -> None:
    model = _starcoder2(0.1).train()
    with pytest.raises(
        UnsupportedModelError, match=r"'starcoder2' has active dropout \(config.residual_dropout"
    ):
        check_supported(model, 32)
    check_supported(model.eval(), 32)  # control: eval mode draws no masks


def test_biogpt_attention_probs_dropout_is_refused_in_train_mode() -> None:
    model = _model(
        "biogpt", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.0, activation_dropout=0.0,
    ).train()  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"config.attention_probs_dropout_prob=0.1"):
        check_supported(model, 32, probe=False)


def test_dropout_no_name_reveals_is_caught_by_running_the_same_tokens_twice() -> None:
    """The layers keep the 0.1 they were built with; the config says 0, so only behaviour can tell."""
    model = _starcoder2(0.1).train()
    model.config.residual_dropout = 0.0
    state = torch.random.get_rng_state()
    with pytest.raises(
        UnsupportedModelError, match="different outputs for the same tokens twice in train mode"
    ):
        check_supported(model, 32)
    assert torch.equal(torch.random.get_rng_state(), state), "probing changed the random state"
    check_supported(model.eval(), 32)


@pytest.mark.parametrize(
    "layout",
    [
        dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1),  # one KV copy per loop
        dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1, recurrent_kv_cache_mode="last_loop"),
        dict(num_hidden_layers=2),  # the default 8 input and 8 output layers: both sections run both layers
        dict(num_hidden_layers=2, n_input_layers=0, n_output_layers=0),  # every layer in the loop
    ],
    ids=["per-loop", "last-loop", "two-layers", "all-looped"],
)
def test_a_looped_model_is_refused_as_looped_before_any_probe(layout: dict[str, Any]) -> None:
    """Dory runs layers several times per forward; resident KV holds one entry per layer. The refusal says
    so whatever the loop does to the cache (more KV caches, one cache read by earlier loops, or a cache the
    split probe's mask does not fit), never as a probe's internal error."""
    model = _model("dory", **SMALL, head_dim=8, n_recurrent_loops=2, **layout).eval()
    with pytest.raises(
        UnsupportedModelError, match=r"'dory' runs decoder block \d 2 times in one forward \(a looped"
    ):
        check_supported(model, 32)
    with pytest.raises(UnsupportedModelError, match="looped transformer"):  # train mode: the same reason
        check_supported(model.train(), 32, probe=False)


def test_a_loop_of_no_layers_is_accepted() -> None:
    """Control: with no layers in the loop section Dory runs each layer once, and the check accepts it."""
    model = _model("dory", **SMALL, head_dim=8, num_hidden_layers=2, n_input_layers=1, n_output_layers=1)
    check_supported(model.eval(), 32)


def test_more_caches_than_attention_layers_still_reads_as_looped() -> None:
    """The split probe's cache count, behind the block count, names the same reason."""
    model = _model("dory", **SMALL, head_dim=8, num_hidden_layers=3, n_input_layers=1, n_output_layers=1)
    with pytest.raises(UnsupportedModelError, match=r"keeps 4 KV caches for 3 attention layers.*looped"):
        support_probes.check_cache_count(model, "dory", 4)


def _bidirectional() -> PreTrainedModel:
    return _model("gemma3_text", **SMALL, num_hidden_layers=2, head_dim=8, use_bidirectional_attention=True)


def test_a_bidirectional_config_is_refused_as_bidirectional() -> None:
    with pytest.raises(UnsupportedModelError, match="bidirectional attention") as info:
        check_supported(_bidirectional().eval(), 32)
    assert "cache carries state" not in str(info.value)


def test_the_probe_names_non_causal_attention_by_behaviour() -> None:
    """Past the config flag, the split probe itself tells a prefix that sees later tokens from a bad cache."""
    with pytest.raises(UnsupportedModelError, match="attention is not causal") as info:
        support_probes.probe_split(_bidirectional().eval(), "gemma3_text")
    assert "cache carries state" not in str(info.value)


def test_an_exception_inside_the_probe_becomes_a_refusal_naming_type_and_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")

    monkeypatch.setattr(support_probes, "decoder_forward", broken)
    with pytest.raises(
        UnsupportedModelError, match=r"'llama' failed the split probe \(RuntimeError: The size"
    ):
        check_supported(tiny_model("llama", VOCAB), 32)


def _preset(family: str) -> PreTrainedModel:
    return tiny_model(family, VOCAB, attn="eager" if family in EAGER_ONLY else "sdpa").eval()


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2", "falcon_h1"])
def test_logit_scaling_and_final_soft_capping_are_applied_by_the_head(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Granite divides its logits, Cohere and Falcon-H1 (`lm_head_multiplier`) multiply them, Gemma 2
    soft-caps them; the engine's head does the same, and the head check is what shows it: a head without the
    transform is refused."""
    model = _preset(family)
    assert not logit_head.logit_transform(model.config).identity
    check_supported(model, 32)
    monkeypatch.setattr(logit_head, "logit_transform", lambda config: logit_head.LogitTransform())
    with pytest.raises(
        UnsupportedModelError, match=rf"'{family}': the model changes its logits after the LM head"
    ):
        check_supported(model, 32)


def test_attention_soft_capping_is_applied_by_shared_past_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2 caps its attention scores; shared-past attention caps them too (on its reference kernel), and
    the probe is what shows it: shared-past attention that leaves the cap out is refused."""
    model = _preset("gemma2")
    assert shared_past_reason(model) is None
    assert "attn_logit_softcapping" in str(attention.shared_past_kernel_note(model))
    check_supported(model, 32)
    real = attention.shared_attention

    def uncapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        *rest, form = args
        return real(*rest, replace(form, softcap=None), **kwargs)

    monkeypatch.setattr(attention, "shared_attention", uncapped)
    with pytest.raises(
        UnsupportedModelError, match=r"'gemma2'.*shared-past attention over resident KV changes"
    ):
        check_supported(model, 32)


@pytest.mark.parametrize(
    "family", ["gpt2", "gpt_bigcode", "opt", "falcon", "bloom", "gptj", "codegen", "mpt", "ctrl"]
)
def test_blocks_under_other_names_are_found_and_checked_by_behaviour(family: str) -> None:
    """`.h` (GPT-2, GPT-J, CodeGen, Falcon, BLOOM, GPTBigCode, CTRL), `.blocks` (MPT), `model.decoder.layers`
    (OPT): learned absolute positions, ALiBi and rotary alike pass the split probe."""
    row = support_row(family)
    assert row.status == "accepted", row


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("openai-gpt", "returns no KV cache from its forward"),
        ("bert", r"has no decoder stack with its blocks in `.layers`, `.h`, `.blocks`"),
        ("diffllama", "attend over other tensors than they cache"),
        ("minimax", r"runs its recurrence inline in its forward.*MiniMaxCache's linear cache"),
        ("qwen4_exp_text", r"QSA pools its keys into blocks and reads the past's positions"),
        ("lfm2", r"\['conv'\] \(short-convolution layers"),
    ],
)
def test_refusals_give_the_true_reason(family: str, reason: str) -> None:
    row = support_row(family)
    assert row.status == "refused" and re.search(reason, row.note), row
    assert "looped" not in row.note


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa", "axk2", "llama4_text"])
def test_indexed_and_chunked_attention_families_are_checked_on_small_models_with_those_layers(
    family: str,
) -> None:
    """Their tiny models are built (under `MAX_PARAMETERS`) with their distinctive layers: the page says
    what was checked, not "not checked"."""
    model = AutoModelForCausalLM.from_config(tiny_family_config(family))
    kinds = {type(m).__name__ for m in model.modules()}
    assert sum(p.numel() for p in model.parameters()) < MAX_PARAMETERS
    assert any("Indexer" in k for k in kinds) or model.config.get_text_config().attention_chunk_size == 6


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa", "axk2"])
def test_indexed_attention_families_are_accepted_with_their_indexer_keys_resident(family: str) -> None:
    """Their indexers' keys are resident beside the latents (`tests/models/test_indexed_attention.py` holds
    them to the flat reference); the row says so and that they take the concatenated past."""
    row = support_row(family)
    assert row.status == "accepted" and "indexed_attention" in row.tiny, row
    assert "indexer's keys are resident" in row.note and "concatenated past" in row.note, row


def test_llama4_text_is_accepted_with_its_chunked_layers() -> None:
    """Its chunked layers attend over the resident past in chunks (`tests/models/test_chunked_attention.py`
    holds them to the flat reference); the row says the chunk the probes crossed."""
    row = support_row("llama4_text")
    assert row.status == "accepted" and "chunked_attention" in row.tiny and "chunk 6" in row.tiny, row


@pytest.mark.parametrize(
    ("family", "note"),
    [
        ("gemma3n_text", "cross-layer KV sharing"),
        ("gemma4_text", "cross-layer KV sharing"),
        ("longcat_flash", "multi-head latent attention"),  # two attention sublayers per block, not a loop
        ("deepseek_v2", "multi-head latent attention"),
        ("glm4_moe_lite", "multi-head latent attention"),
        ("minicpm3", "multi-head latent attention"),
        ("youtu", "multi-head latent attention"),
        ("jetmoe", "concatenated past, because its cache holds other tensors"),
    ],
)
def test_kv_sharing_and_mla_families_are_accepted(family: str, note: str) -> None:
    row = support_row(family)
    assert row.status == "accepted" and note in row.note, row


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("xlstm", r"keeps its recurrent state in its own `xLSTMCache` .*not a transformers Cache"),
        (
            "recurrent_gemma",
            r"on its own modules \(RecurrentGemmaRecurrentBlock.conv1d_state, RecurrentGemmaRglru.recurrent_states",
        ),
    ],
)
def test_state_kept_outside_the_cache_is_refused_with_where_it_is_kept(family: str, reason: str) -> None:
    row = support_row(family)
    assert row.status == "refused" and re.search(reason, row.note), row
    assert "the Cache it gives the forward (`EngineCache`" in row.note, row  # what the engine would need


def test_state_in_a_forward_argument_is_refused_unless_the_engine_fills_it() -> None:
    """RWKV passes its state through its forward's `state` list; the engine fills that argument itself
    (`treetrain.models.rwkv_state`), so RWKV is accepted, and the reason stands for any other model whose
    forward argument it does not fill."""
    model = tiny_model("rwkv", VOCAB, attn="eager").eval()
    reason = forward_state_reason(model)
    assert reason is not None and re.search(
        r"in the `state` argument of its forward .*not in a Cache", reason
    )
    assert forward_state_reason(model, supplied="state") is None
    row = support_row("rwkv")
    assert row.status == "accepted" and "(wkv)" in row.note, row


@pytest.mark.parametrize("family", ["qwen3_5_text", "mamba", "zamba2", "llama"])
def test_state_kept_in_the_cache_is_not_flagged(family: str) -> None:
    """Negative control: recurrent families whose state lives in the Cache pass both checks."""
    model = tiny_model(family, VOCAB, attn="eager" if family in EAGER_ONLY else "sdpa").eval()
    assert forward_state_reason(model) is None
    assert module_state_reason(model) is None
    check_supported(model, 32)


def test_module_held_state_is_found_by_behaviour_not_by_family() -> None:
    """A Llama whose first MLP keeps its last input on itself and adds it to the next call's output is
    refused the way RecurrentGemma is, naming the attribute; the probe leaves the model as it found it.
    Negative control: the same stash that changes no output is found, yet the model is accepted (the
    support check asks where state lives only for a model it refuses anyway)."""
    model = tiny_model("llama", VOCAB).eval()
    mlp = model.model.layers[0].mlp
    plain = type(mlp).forward
    carry = {"on": False}

    def stashing(x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        before = vars(mlp).get("memory")
        mlp.memory = x[:, -1]  # [B, H]: per-row state outside any cache
        out = plain(mlp, x)
        if carry["on"] and before is not None and before.shape == mlp.memory.shape:
            out = out + before[:, None]
        return out

    mlp.forward = stashing
    reason = module_state_reason(model)
    assert reason is not None and "on its own modules (LlamaMLP.memory" in reason, reason
    assert "memory" not in vars(mlp), "probing left the state on the module"
    check_supported(model, 32)  # control: state that changes nothing is no reason to refuse
    carry["on"] = True
    with pytest.raises(UnsupportedModelError, match=r"'llama' keeps its recurrent state on its own modules"):
        check_supported(model, 32)


def test_recurrent_gemma_state_probe_leaves_its_modules_as_they_were() -> None:
    model = AutoModelForCausalLM.from_config(tiny_family_config("recurrent_gemma")).eval()
    blocks = [m for m in model.modules() if hasattr(m, "conv1d_state")]
    assert blocks and all(b.conv1d_state is None for b in blocks)
    assert module_state_reason(model) is not None
    assert all(b.conv1d_state is None for b in blocks), "probing left state on the modules"
