"""The dropout check judges the dropout that runs: `nn.Dropout` modules the causal LM's forward calls with
p > 0 in train mode, and the attention dropout its attention layers hand their attention function; never a
config field the causal LM does not read. A `PeftModel` and the same adapters injected into the model are
judged the same way, by the modules that run, not by the wrapper's own `training` flag."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from treetrain.models.lora import peft_quiet
from treetrain.models.module_modes import training
from treetrain.models.support import UnsupportedModelError, check_supported
from treetrain.models.tiny_family import tiny_family_config

FORMS = ("peft_model", "injected")


def _neox(form: str, mode: str, lora_dropout: float = 0.0, **dropouts: float) -> Any:
    """A tiny GPT-NeoX whose config carries `classifier_dropout=0.1` (the token-classification head's, not
    the causal LM's), with LoRA on its attention projection as a `PeftModel` or injected."""
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    config = tiny_family_config("gpt_neox", {"classifier_dropout": 0.1, **dropouts})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model.train(mode == "train")
        lora = LoraConfig(r=4, target_modules=["query_key_value"], lora_dropout=lora_dropout)
        with peft_quiet():
            return (
                get_peft_model(model, lora) if form == "peft_model" else inject_adapter_in_model(lora, model)
            )


def _refusal(model: Any) -> str | None:
    try:
        check_supported(model, 32)
    except UnsupportedModelError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("form", FORMS)
def test_a_config_field_the_causal_lm_never_reads_is_not_dropout(form: str, mode: str) -> None:
    """GPT-NeoX's `classifier_dropout` builds no module of the causal LM: accepted in either mode, as a
    PeftModel (whose wrapper says train mode even around an eval-mode model) and injected."""
    assert _refusal(_neox(form, mode)) is None


@pytest.mark.parametrize(
    ("dropouts", "named"),
    [
        ({"hidden_dropout": 0.1}, "gpt_neox.emb_dropout (p=0.1)"),
        (
            {"attention_dropout": 0.1},
            "attention dropout 0.1 passed to the attention function by gpt_neox.layers.0.attention; "
            "config.attention_dropout=0.1",
        ),
    ],
    ids=["module", "attention"],
)
def test_dropout_that_runs_is_refused_the_same_way_for_both_forms(
    dropouts: dict[str, float], named: str
) -> None:
    """Negative controls: dropout modules and attention dropout that run in train mode are refused, naming
    the module as the model itself names it in both forms; in eval mode nothing draws a mask."""
    want = f"model type 'gpt_neox' has active dropout ({named}) in train mode"
    for form in FORMS:
        assert (_refusal(_neox(form, "train", **dropouts)) or "").startswith(want), form
        assert _refusal(_neox(form, "eval", **dropouts)) is None, form


def test_lora_dropout_is_refused_the_same_way_for_both_forms() -> None:
    """LoRA's own dropout runs in the adapter layers PEFT injects, which start in train mode even around an
    eval-mode model: refused (naming it alike) in both forms until the whole model is put in eval mode."""
    name = "gpt_neox.layers.0.attention.query_key_value.lora_dropout.default (p=0.1)"
    for form in FORMS:
        model = _neox(form, "eval", lora_dropout=0.1)
        assert training(model)
        assert re.search(re.escape(f"has active dropout ({name}) in train mode"), _refusal(model) or ""), form
        assert _refusal(model.eval()) is None, form


def test_refusal_and_acceptance_leave_every_module_mode_as_found() -> None:
    """The check puts the model in eval mode for its probes and gives each module its own mode back: an
    eval-mode model behind a train-mode wrapper stays in eval mode (the wrapper's flag is not the model's)."""
    for model in (_neox("peft_model", "eval"), _neox("peft_model", "eval", hidden_dropout=0.1)):
        modes = [m.training for m in model.modules()]
        assert model.training and not model.get_base_model().training
        _refusal(model)
        assert [m.training for m in model.modules()] == modes


def test_the_watch_is_undone_even_when_the_forward_fails() -> None:
    """The attention interface and every hook are restored after the forward, also when it raises."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from treetrain.models.observed_forward import observe_forward

    model = _neox("injected", "train", hidden_dropout=0.1)
    ids, pos = torch.arange(1, 9)[None], torch.arange(8)[None]
    assert observe_forward(model, ids, pos).dropout == "gpt_neox.emb_dropout (p=0.1)"
    with pytest.raises(IndexError):
        observe_forward(model, ids + 1000, pos)  # past the vocabulary
    assert "get_interface" not in vars(ALL_ATTENTION_FUNCTIONS)
    assert all(not m._forward_pre_hooks for m in model.modules())
