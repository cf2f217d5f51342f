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
#: More tiny presets, one per mechanism the engine reproduces beyond those: multi-head latent attention
#: (DeepSeek V3: a value head smaller than the query/key head, a cache of compressed latents), logits
#: divided (Granite) and multiplied (Cohere) after the head, attention and final-logit soft-capping
#: (Gemma 2), blocks in `.h` with learned absolute positions (GPT-2), and cross-layer KV sharing (Gemma 4).
MORE_FAMILIES: tuple[str, ...] = ("deepseek_v3", "granite", "cohere", "gemma2", "gpt2", "gemma4_text")
#: Presets with recurrent layers, whose resident state per layer is (conv state, recurrent state) or KV
#: (`treetrain.models.recurrent_state`): Gated DeltaNet around a full-attention layer, Mamba layers alone
#: (Mamba, Falcon-Mamba) or around an attention layer (Jamba), Kimi delta attention around an MLA layer, and
#: layers that hold both (Zamba 2's hybrid layers: a shared transformer block, then a Mamba-2 mixer), and
#: RWKV (no attention; its state passes through its forward's `state` list, `treetrain.models.rwkv_state`).
RECURRENT_FAMILIES: tuple[str, ...] = (
    "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "lara_mini", "mamba", "falcon_mamba", "jamba",
    "bamba", "granitemoehybrid", "nemotron_h", "kimi_linear", "bailing_hybrid", "zamba2", "falcon_h1", "zamba",
    "rwkv",
)  # fmt: skip
#: Of those, the ones whose recurrent layers are Mamba-2 (chunked SSD scan) layers.
MAMBA2_FAMILIES = frozenset({"bamba", "granitemoehybrid", "nemotron_h", "zamba2", "falcon_h1"})
#: Of those, the ones with hybrid layers: KV and recurrent state in one layer (Zamba 2: a shared transformer
#: block, then a Mamba-2 mixer; Falcon-H1: attention and a Mamba-2 mixer side by side in every layer; Zamba:
#: a shared transformer block, then a Mamba mixer scanning each of its heads on its own).
HYBRID_FAMILIES = frozenset({"zamba2", "falcon_h1", "zamba"})
#: Of those, the ones whose recurrent layers are Mamba (selective scan) layers.
MAMBA_FAMILIES = frozenset({"mamba", "falcon_mamba", "jamba", "zamba"})
#: Of those, the ones whose recurrent layers are Kimi delta attention (a per-channel gated delta rule)
#: around a multi-head latent attention layer.
KIMI_DELTA_FAMILIES = frozenset({"kimi_linear", "bailing_hybrid"})
#: Families whose transformers classes have no `sdpa` attention.
EAGER_ONLY = frozenset({"gemma2", "mamba", "falcon_mamba", "rwkv"})
#: transformers' per-expert loop, the experts implementation of a mixture-of-experts checkpoint in float64:
#: the default grouped-matmul kernel takes float32, bfloat16 and float16 only. The tiny presets use it in
#: every dtype, so the tests' references run the same code in float32 and float64.
PER_EXPERT_LOOP = "eager"
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
    known = FAMILIES + MORE_FAMILIES + RECURRENT_FAMILIES
    if family not in known:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(known)}")
    if attn not in ATTENTION:
        raise ValueError(f"unknown attention implementation {attn!r}; known: {', '.join(ATTENTION)}")
    if family in EAGER_ONLY and attn != "eager":
        raise ValueError(
            f"{family} has only eager attention in transformers: use --attn eager (model.attn=eager)"
        )
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
    common.update(_more(family, size, vocab_size))
    config = AutoConfig.for_model(family, **common)
    config._attn_implementation = attn
    if family in (
        "qwen3_moe",
        "deepseek_v3",
        "qwen3_5_moe_text",
        "qwen3_next",
        "lara_mini",
        "jamba",
        "granitemoehybrid",
        "nemotron_h",
        "kimi_linear",
        "bailing_hybrid",
    ):
        config._experts_implementation = PER_EXPERT_LOOP
    return config


def _more(family: str, size: TinySize, vocab_size: int) -> dict[str, Any]:
    """Config fields of a `MORE_FAMILIES` preset beyond the common ones (nothing for `FAMILIES`)."""
    head = size.hidden_size // size.num_heads
    if family == "deepseek_v3":  # MLA: query/key heads of head + head // 2, value heads of head
        return dict(
            num_key_value_heads=size.num_heads, q_lora_rank=size.hidden_size // 2, kv_lora_rank=size.hidden_size // 2,
            qk_nope_head_dim=head, qk_rope_head_dim=head // 2, v_head_dim=head, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=size.intermediate_size // 4, first_k_dense_replace=1,
            n_group=1, topk_group=1,
        )  # fmt: skip
    if family == "granite":
        return dict(logits_scaling=4.0)
    if family == "cohere":
        return dict(logit_scale=2.0)
    if family == "gemma2":  # caps low enough to bend a tiny random model's scores and logits
        return dict(
            head_dim=head,
            attn_logit_softcapping=0.005,
            final_logit_softcapping=0.2,
            sliding_window=MISTRAL_WINDOW,
        )
    if family == "gpt2":
        return dict(
            n_embd=size.hidden_size, n_layer=size.num_layers, n_head=size.num_heads, n_inner=size.intermediate_size,
            num_key_value_heads=size.num_heads,  # GPT-2 has no grouped-query heads
            n_positions=size.max_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        )  # fmt: skip
    if family == "gemma4_text":  # the second half of the layers reuses the first half's KV, per layer type
        layers = max(4, size.num_layers)
        return dict(
            num_hidden_layers=layers, num_kv_shared_layers=layers // 2, head_dim=head, global_head_dim=head,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size, sliding_window=MISTRAL_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        )  # fmt: skip
    if family in MAMBA2_FAMILIES:  # Mamba-2 layers around one attention layer
        mamba2: dict[str, Any] = dict(
            num_hidden_layers=3, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2,
        )  # fmt: skip
        if family == "falcon_h1":  # every layer hybrid; the muP multipliers all away from 1
            return dict(
                num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8,
                mamba_d_conv=4, mamba_chunk_size=16, head_dim=head, lm_head_multiplier=0.5, embedding_multiplier=2.0,
                key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.8,
                ssm_in_multiplier=1.2, ssm_out_multiplier=0.9, mlp_multipliers=[1.1, 0.9],
                ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
            )  # fmt: skip
        if family == "zamba2":  # Mamba-2, hybrid, Mamba-2, hybrid: two invocations of one shared block
            return dict(
                layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"], num_hidden_layers=4,
                n_mamba_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, chunk_size=16,
                num_mem_blocks=1, use_mem_rope=True,
            )  # fmt: skip
        if (
            family == "nemotron_h"
        ):  # Mamba-2, experts, attention, Mamba-2, MLP: stateless blocks in the layer list
            return dict(
                layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
                mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=8, conv_kernel=4, expand=2,
                chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1, use_mamba_kernels=False,
            )  # fmt: skip
        if family == "bamba":
            mamba2.update(attn_layer_indices=[1])
        else:
            mamba2.update(layer_types=["mamba", "attention", "mamba"])
        return mamba2
    if family in MAMBA_FAMILIES:  # Mamba layers only, or (Jamba) around one attention layer with experts
        more: dict[str, Any] = dict(state_size=8, conv_kernel=4, expand=2, num_hidden_layers=3)
        if family == "zamba":  # Mamba, hybrid, Mamba, hybrid: two invocations of one shared block
            return dict(
                layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"], num_hidden_layers=4,
                n_mamba_heads=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            )  # fmt: skip
        if family == "jamba":
            more = dict(
                num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                mamba_expand=2, use_mamba_kernels=False,
            )  # fmt: skip
        return more
    if family == "rwkv":  # WKV time mixing and channel mixing in every block, no attention
        return dict(attention_hidden_size=size.hidden_size, context_length=size.max_positions)
    if family in KIMI_DELTA_FAMILIES:  # KDA before and after an MLA layer; experts after the first layer
        kda: dict[str, Any] = dict(
            num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_key_value_heads=size.num_heads, q_lora_rank=size.hidden_size // 2, kv_lora_rank=size.hidden_size // 2,
            qk_nope_head_dim=head, qk_rope_head_dim=head // 2, v_head_dim=head, num_local_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=size.intermediate_size // 4, n_group=1, topk_group=1,
        )  # fmt: skip
        if family == "kimi_linear":
            return dict(kda, linear_num_heads=size.num_heads, linear_head_dim=head, linear_conv_kernel_dim=4)
        # Bailing sizes its linear heads by `num_attention_heads` and `head_dim`
        return dict(kda, head_dim=head, short_conv_kernel_size=4, first_k_dense_replace=1)
    if family in RECURRENT_FAMILIES:  # linear attention before and after the full-attention layer
        more = dict(
            num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
            head_dim=head, linear_num_key_heads=size.num_kv_heads, linear_num_value_heads=size.num_heads,
            linear_key_head_dim=head, linear_value_head_dim=head, linear_conv_kernel_dim=4,
        )  # fmt: skip
        if family == "lara_mini":  # its attention layers are windowed, shorter than the test sequences
            more.update(layer_types=["linear_attention", "sliding_attention", "linear_attention"])
            more.update(sliding_window=MISTRAL_WINDOW)
        if family in ("qwen3_5_moe_text", "qwen3_next", "lara_mini"):
            more.update(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=size.intermediate_size // 2,
                shared_expert_intermediate_size=size.intermediate_size // 2,
            )  # fmt: skip
        return more
    return {}


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
        presets = ", ".join(f"tiny-{f}" for f in FAMILIES + MORE_FAMILIES + RECURRENT_FAMILIES)
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
        presets = ", ".join(f"tiny-{f}" for f in FAMILIES + MORE_FAMILIES + RECURRENT_FAMILIES)
        raise FileNotFoundError(f"model {name!r} is neither a local directory nor a preset ({presets})")
    check_checkpoint(path)  # config.json's sizes against the weight files, before anything is allocated
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn, use_safetensors=True, local_files_only=True,
        experts_implementation=PER_EXPERT_LOOP if dtype == torch.float64 else None,
    )  # fmt: skip
    own_storage(model)
    return model


def own_storage(model: torch.nn.Module) -> int:
    """Give every parameter that is a view into a larger tensor a storage of its own; returns how many.

    transformers' loading conversions split a checkpoint's fused tensor into views of it (Lara's
    `in_proj_qkvz` into `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a`). safetensors refuses to save
    a view that does not cover its storage, so a run's checkpoint failed, and each view kept the whole
    fused tensor alive. A tied weight is one parameter and covers its storage: it stays shared.

    >>> linear = torch.nn.Linear(4, 2)
    >>> linear.weight.data = torch.zeros(4, 4)[:2]
    >>> own_storage(linear), linear.weight.untyped_storage().nbytes()
    (1, 32)
    """
    copied = 0
    for p in model.parameters():
        if p.untyped_storage().nbytes() != p.numel() * p.element_size():
            p.data = p.data.clone(memory_format=torch.contiguous_format)
            copied += 1
    return copied
