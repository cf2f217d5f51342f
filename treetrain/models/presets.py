"""Tiny random-init configs of real model families, for tests, benchmarks and `--model tiny-<family>`.

They are real Hugging Face classes with real cache and attention code, only small. Nothing is
downloaded: real checkpoints load with `from_pretrained(local_dir)` (see `load_model`).

Example:
    >>> model = tiny_model("qwen3", vocab_size=64, seed=0)
    >>> type(model).__name__, model.config.num_hidden_layers
    ('Qwen3ForCausalLM', 2)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from treetrain.models import ATTENTION
from treetrain.models.checkpoint_bounds import check_checkpoint, checkpoint_config

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")
#: The tiny Mistral's sliding window: shorter than test sequences, so windowed attention is exercised.
MISTRAL_WINDOW = 12


@dataclass(frozen=True)
class TinySize:
    """Shape of a tiny preset. The defaults give a model of about 100k parameters."""

    hidden_size: int = 32
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention when smaller than num_heads)."""
    intermediate_size: int = 64
    """MLP width (per expert for MoE)."""
    max_positions: int = 16384
    """Maximum sequence length (RoPE table size)."""


def tiny_config(
    family: str, vocab_size: int, size: TinySize = TinySize(), attn: str = "sdpa"
) -> PretrainedConfig:
    """A small config of `family`; raises ValueError naming the known families otherwise."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    if attn not in ATTENTION:
        raise ValueError(f"unknown attention implementation {attn!r}; known: {', '.join(ATTENTION)}")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=size.max_positions,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    if family == "mistral":
        common["sliding_window"] = MISTRAL_WINDOW  # shorter than the test sequences, so the window is active
    if family == "qwen3_moe":
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=size.intermediate_size // 2)
    if family in ("qwen3", "qwen3_moe"):
        common["head_dim"] = size.hidden_size // size.num_heads
    config = AutoConfig.for_model(family, **common)
    config._attn_implementation = attn
    if family == "qwen3_moe":
        # The grouped-matmul experts kernel has no float64 path; the per-expert loop does.
        config._experts_implementation = "eager"
    return config


def tiny_model(
    family: str,
    vocab_size: int,
    *,
    size: TinySize = TinySize(),
    attn: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PreTrainedModel:
    """A random-init model of `family`, deterministic for a given seed."""
    config = tiny_config(family, vocab_size, size, attn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config,
            attn_implementation=attn,
            dtype=dtype,
            experts_implementation=getattr(config, "_experts_implementation", None),
        )
    return model


def model_config(
    path_or_preset: str | Path, *, vocab_size: int | None = None, attn: str = "sdpa"
) -> PretrainedConfig:
    """The text config `load_model` would build the model from, read without weights: a checkpoint's
    `config.json`, or the preset's config (which needs `vocab_size`). Callers check untrusted input (token
    ids, lengths) against it before any model is built or sized."""
    name = str(path_or_preset)
    if name.startswith("tiny-"):
        if vocab_size is None:
            raise ValueError(f"preset {name!r} needs a vocab_size (take it from the tokenizer)")
        return tiny_config(name.removeprefix("tiny-"), vocab_size, attn=attn)
    if not Path(name).is_dir():
        presets = ", ".join(f"tiny-{f}" for f in FAMILIES)
        raise FileNotFoundError(f"model {name!r} is neither a local directory nor a preset ({presets})")
    config = checkpoint_config(name)  # within limits, every failure one ValueError line
    return config.get_text_config(decoder=True)


def load_model(
    path_or_preset: str | Path,
    *,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    attn: str = "sdpa",
    seed: int = 0,
) -> PreTrainedModel:
    """Load a local checkpoint directory, or build `tiny-<family>` (which needs `vocab_size`).

    Weights load through safetensors (`use_safetensors=True`); nothing is fetched from a hub. A directory is
    checked first (`treetrain.models.checkpoint_bounds.check_checkpoint`): its config.json never sizes a model larger
    than its weight files.
    """
    name = str(path_or_preset)
    if name.startswith("tiny-"):
        if vocab_size is None:
            raise ValueError(f"preset {name!r} needs a vocab_size (take it from the tokenizer)")
        try:
            return tiny_model(name.removeprefix("tiny-"), vocab_size, attn=attn, dtype=dtype, seed=seed)
        except (
            RuntimeError
        ) as exc:  # the allocator's refusal (a vocabulary near the 2^24 allowed, little memory)
            raise ValueError(
                f"cannot build {name} with a vocabulary of {vocab_size}: {' '.join(str(exc).split())[:200]}"
            ) from None
    path = Path(name)
    if not path.is_dir():
        presets = ", ".join(f"tiny-{f}" for f in FAMILIES)
        raise FileNotFoundError(f"model {name!r} is neither a local directory nor a preset ({presets})")
    check_checkpoint(path)  # config.json's sizes against the weight files, before anything is allocated
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn, use_safetensors=True, local_files_only=True
    )
