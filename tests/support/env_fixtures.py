"""Shared helpers for the environment, wrapper and rollout tests: the shipped tokenizer, a tiny
random-init model, and small scripted environments with known dynamics."""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from support.scripted_envs import FixedTurnsEnv, FlakyToolsEnv, NoisyEnv, TurnCount
from treetrain.assets import tokenizer_path

__all__ = [
    "END",
    "FixedTurnsEnv",
    "FlakyToolsEnv",
    "NoisyEnv",
    "TurnCount",
    "encode",
    "tiny_model",
    "tokenizer",
]

END = "<|im_end|>"


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_path())


def encode(text: str) -> tuple[int, ...]:
    return tuple(tokenizer().encode(text, add_special_tokens=False))


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64, init: float = 0.5) -> LlamaForCausalLM:
    """A random-init Llama over the shipped tokenizer's vocabulary (hidden 32, 2 layers).

    The large init scale makes outputs depend visibly on far-back context, so a wrong KV cache
    changes the sampled tokens (with the default 0.02, a dropped token barely moves the logits)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer()),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=init,
    )
    model = LlamaForCausalLM(config).to(dtype)  # type: ignore[arg-type]
    return model.eval()
