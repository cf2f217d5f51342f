"""Tiny mixture-of-experts models over the shipped tokenizer, as transformers holds them in memory (experts
fused into 3-D stacks), for the export and vLLM tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from treetrain.assets import tokenizer_path

__all__ = ["save_tiny_moe", "tiny_moe"]


def tiny_moe(family: str = "qwen3_moe", seed: int = 0) -> Any:
    """A random float32 MoE of `family` with 64-wide heads (what vLLM's CPU attention serves), 4 experts of
    which each token takes 2, and every expert different (a swap of two experts changes the function)."""
    torch.manual_seed(seed)
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_path()))
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, max_position_embeddings=1024, num_experts_per_tok=2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    if family == "qwen3_moe":
        model: Any = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=64, num_experts=4)
        )
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=64, num_local_experts=4))
    else:
        raise ValueError(f"no tiny MoE of family {family!r}")
    return model.float().eval()


def save_tiny_moe(directory: Path, family: str = "qwen3_moe", seed: int = 0) -> Path:
    """`tiny_moe` saved as a checkpoint directory with the shipped tokenizer (what vLLM starts from)."""
    tiny_moe(family, seed).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_path()).save_pretrained(directory)
    return directory
