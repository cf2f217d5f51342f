"""Tiny PEFT-wrapped models for the LoRA tests: every preset family and one family outside the presets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from support.replay_cases import VOCAB
from treetrain.models.lora import LoraSection, apply_lora
from treetrain.models.presets import tiny_model

#: Phi-3 is not a preset; its attention projection is one fused `qkv_proj`.
OTHER_FAMILY = "phi3"
TARGETS = {OTHER_FAMILY: ("qkv_proj", "o_proj")}


def base_model(family: str, dtype: torch.dtype, seed: int = 1) -> Any:
    if family != OTHER_FAMILY:
        return tiny_model(family, VOCAB, dtype=dtype, seed=seed)
    config = AutoConfig.for_model(
        OTHER_FAMILY, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)


@torch.no_grad()
def trained_like(model: Any, seed: int = 5) -> Any:
    """Give every adapter B a random value, as after training (PEFT starts B at 0: adapters off = on)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ".lora_B." in name and p.requires_grad:  # the trained adapter, not a frozen one
            p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return model


def lora_factory(family: str, dtype: torch.dtype, r: int = 4, **kw: Any) -> Callable[[], Any]:
    targets = TARGETS.get(family)
    section = LoraSection(r=r, **({"target_modules": targets} if targets else {}), **kw)

    def make() -> Any:
        model = base_model(family, dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)  # PEFT draws A from the global generator
            return trained_like(apply_lora(model, section))

    return make
