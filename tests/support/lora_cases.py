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


def other_config() -> Any:
    """The tiny Phi-3 config (not a preset)."""
    return AutoConfig.for_model(
        OTHER_FAMILY, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip


def base_model(family: str, dtype: torch.dtype, seed: int = 1) -> Any:
    if family != OTHER_FAMILY:
        return tiny_model(family, VOCAB, dtype=dtype, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(other_config(), attn_implementation="sdpa", dtype=dtype)


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


# ----- the same adapters as a PeftModel and injected into the model ---------------------------------------
#: The two ways a user hands treetrain LoRA adapters: PEFT's wrapper (`get_peft_model`, a `PeftModel` whose
#: model sits at `base_model.model`) and the adapter layers injected into the model itself
#: (`inject_adapter_in_model`, the model's own class and attribute paths).
FORMS = ("peft_model", "injected")
#: Gemma 3n beside the LoRA families: per-layer embeddings, AltUp, laurel and KV-sharing layers, a soft-capped
#: head, and a train mode that computes something else (AltUp clamps its coefficients and bypasses an adapter
#: on `correction_coefs`), with adapters on every linear layer.
GEMMA3N = "gemma3n_text"
#: Attention dropout in every checkpoint-like config: no mask in eval mode, a new one per forward in train
#: mode, so a check that left the model in train mode shows in the gradient.
ATTENTION_DROPOUT = 0.1


def checkpoint_like(family: str, dtype: torch.dtype, dropout: float = ATTENTION_DROPOUT) -> Any:
    """A tiny `family` model as `from_pretrained` hands one over: in eval mode, its config with attention
    `dropout` (inactive while it stays in eval mode)."""
    from treetrain.models.presets import tiny_config
    from treetrain.models.tiny_family import tiny_family_config

    if family == GEMMA3N:
        config = tiny_family_config(GEMMA3N)
    elif family == OTHER_FAMILY:
        config = other_config()
    else:
        config = tiny_config(family, VOCAB)
    config.attention_dropout = dropout
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(
            config,
            attn_implementation="sdpa",
            dtype=dtype,
            experts_implementation=getattr(config, "_experts_implementation", None),
        )
    return model.eval()


def form_factory(
    family: str, form: str, dtype: torch.dtype, dropout: float = ATTENTION_DROPOUT
) -> Callable[[], Any]:
    """`checkpoint_like(family, dtype, dropout)` with the same rank-4 LoRA adapters (trained-like B) as a
    `PeftModel` or injected; the base frozen in both."""
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    from treetrain.models.lora import is_adapter_param, peft_quiet

    targets: Any = (
        "all-linear" if family == GEMMA3N else list(TARGETS.get(family, LoraSection().target_modules))
    )

    def make() -> Any:
        model = checkpoint_like(family, dtype, dropout)
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
        with torch.random.fork_rng(devices=[]), peft_quiet():
            torch.manual_seed(3)  # PEFT draws A from the global generator
            if form == "peft_model":
                model = get_peft_model(model, config)
            else:
                model = inject_adapter_in_model(config, model)
                for name, p in model.named_parameters():
                    p.requires_grad_(is_adapter_param(name))
        return trained_like(model)

    return make
