"""`evaluating` gives every module its own mode back; `training` judges the modules, not a wrapper's flag."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from treetrain.models.lora import peft_quiet
from treetrain.models.module_modes import evaluating, training
from treetrain.models.presets import tiny_model


def _wrapped_eval_model() -> torch.nn.Module:
    """An eval-mode model (as `from_pretrained` gives it) in PEFT's wrapper, which starts in train mode."""
    with peft_quiet():
        return get_peft_model(tiny_model("llama", 64).eval(), LoraConfig(r=4, target_modules=["q_proj"]))


def test_each_module_gets_its_own_mode_back() -> None:
    model = _wrapped_eval_model()
    before = [m.training for m in model.modules()]
    assert model.training and not model.get_base_model().model.layers[0].training  # the flags disagree
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == before


def test_negative_control_restoring_the_top_flag_puts_the_model_in_train_mode() -> None:
    """The idiom `evaluating` replaces: the model inside comes out in train mode."""
    model = _wrapped_eval_model()
    was = model.training
    model.eval()
    model.train(was)
    assert model.get_base_model().model.layers[0].training


def test_training_reads_the_modules_that_run() -> None:
    plain = tiny_model("llama", 64).eval()
    assert not training(plain) and training(plain.train())
    wrapped = _wrapped_eval_model()
    assert training(wrapped)  # PEFT's injected adapter layers start in train mode
    assert not training(wrapped.eval())
