"""Tiny configs of every causal-LM family for the support table (`treetrain.models.support_table`): small
sizes under the names most configs use (`_COMMON`), the fields a family needs beyond them (`OVERRIDES`),
and what small sizes would lose of the family's distinctive layers put back (`_distinctive`, `_short_windows`):
every per-layer type its default config has, a sparse layer past the dense-first ones, and a sliding window
or attention chunk short enough that the support check's probe crosses it. A support check on a tiny model
without its family's conv layers, window or experts would say nothing about a checkpoint that has them;
`tests/models/test_layer_kinds.py` holds every accepted family's tiny config to carrying them.

Example:
    >>> config = tiny_family_config("lfm2")
    >>> config.layer_types, config.num_hidden_layers
    (['conv', 'full_attention'], 2)
    >>> tiny_family_config("mistral").sliding_window
    6
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from treetrain.models.layer_kinds import TYPE_LISTS

VOCAB = 64
#: The sliding window and attention chunk of a tiny model whose family has one: shorter than the support
#: check's 12-token probe, so its split lands inside the window and runs past it.
SHORT = 6

#: Sizes under the names most configs use (or map through their `attribute_map`).
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
)  # fmt: skip
_MLA: dict[str, Any] = dict(
    num_key_value_heads=4, head_dim=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
    v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
    n_group=1, topk_group=1,
)  # fmt: skip
_INDEXER: dict[str, Any] = dict(index_topk=4, index_head_dim=8, index_n_heads=16)
_KV_SHARED: dict[str, Any] = dict(
    num_hidden_layers=4, num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
    layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=6, global_head_dim=8,
)  # fmt: skip
#: Fields a family needs beyond `_COMMON` for a tiny model of it to build (and use its mechanism).
OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v2": _MLA, "deepseek_v3": _MLA, "glm4_moe_lite": _MLA, "minicpm3": _MLA, "axk1": _MLA,
    "youtu": _MLA, "sarvam_mla": _MLA,
    "longcat_flash": dict(_MLA, num_layers=2, ffn_hidden_size=64, expert_ffn_hidden_size=16, zero_expert_num=1),
    "granite": dict(logits_scaling=4.0), "granitemoe": dict(logits_scaling=4.0),
    "cohere": dict(logit_scale=2.0), "cohere2": dict(logit_scale=2.0), "cohere2_moe": dict(logit_scale=2.0),
    "gemma2": dict(attn_logit_softcapping=0.005, final_logit_softcapping=0.2),
    "vaultgemma": dict(attn_logit_softcapping=0.005, final_logit_softcapping=0.2),
    "gemma3n_text": dict(
        _KV_SHARED, intermediate_size=[64] * 4, activation_sparsity_pattern=[0.0] * 4, laurel_rank=4,
        altup_num_inputs=2,
    ),
    "gemma4_text": dict(
        _KV_SHARED, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
    ),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, summary_first_dropout=0.0),
    "gptj": dict(rotary_dim=4), "codegen": dict(rotary_dim=4),
    "ctrl": dict(dff=64), "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
    "mpt": dict(d_model=32, n_layers=2, n_heads=4), "xlstm": dict(num_heads=4),
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1, n_recurrent_loops=2),
    "zamba": dict(num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8),
    "zamba2": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=8),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, attn_layer_indices=[1], num_hidden_layers=3),
    "kimi_linear": dict(
        _MLA, linear_num_heads=4, linear_head_dim=8, layer_types=["linear_attention", "full_attention"],
    ),
    "bailing_hybrid": dict(_MLA, head_dim=8, layer_types=["linear_attention", "full_attention"]),
    # Real LFM2 checkpoints are mostly short-conv layers around a few attention layers; the config's
    # default (no `full_attn_idxs`) is attention only.
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "minimax_m3_vl_text": dict(layer_types=["minimax_m3_sparse", "full_attention"]),  # its sparse attention
    "jamba": dict(
        num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
    ),
    "recurrent_gemma": dict(num_hidden_layers=3),  # recurrent, recurrent, (windowed) attention
    "beam": dict(n_group=1, topk_group=1),  # expert groups of the 4 tiny experts
    # Indexed sparse attention (DeepSeek V3.2, GLM-5, AXK2): a small indexer over MLA whose top 4 is shorter
    # than the support check's 12-token probe, so the selection matters; GLM-5 with a layer that reuses the
    # previous layer's selection (`indexer_types` "shared")
    "deepseek_v32": dict(_MLA, **_INDEXER),
    "glm_moe_dsa": dict(_MLA, **_INDEXER, num_hidden_layers=3, indexer_types=["full", "shared", "full"]),
    "axk2": dict(_MLA, **_INDEXER),
    "deepseek_v4": dict(q_lora_rank=16, o_groups=2, o_lora_rank=16, index_topk=4, index_head_dim=8, index_n_heads=2),
    # Phi-3.5-MoE and Doge with the sliding window their attention masks by (their configs default to none)
    "phimoe": dict(sliding_window=SHORT),
    # Llama 4: a chunked RoPE layer and a NoPE full-attention layer, whose temperature tuning (its scale
    # grows with the position, read off the cache) starts within the probe, not at 8192 positions
    "llama4_text": dict(no_rope_layers=[1, 0], floor_scale=2),
    "doge": dict(sliding_window=SHORT),
    "qwen4_exp_text": dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2,
    ),  # recurrent, recurrent, (windowed) attention
    "granitemoehybrid": dict(
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
    ),
}  # fmt: skip


def tiny_family_config(family: str, changes: Mapping[str, Any] | None = None) -> PretrainedConfig:
    """A tiny config of `family`: `_COMMON` sizes with the family's `OVERRIDES` and then `changes` (another
    layer count or layer pattern, say), carrying the family's distinctive layers (`_distinctive`)."""
    fields = dict(_COMMON, **OVERRIDES.get(family, {}))
    fields.update(changes or {})
    config = _config(family, fields)
    laid_out = any("layer" in name for name in {*OVERRIDES.get(family, {}), *(changes or {})})
    more = {} if laid_out else _distinctive(family, config, fields)  # a layout set by hand stays as it is
    if more:
        with contextlib.suppress(Exception):  # a config that takes no such change keeps its own (the
            config = _config(family, dict(fields, **more))  # layer-kinds test names what it lacks)
    return _short_windows(config, fields)


def _config(family: str, fields: dict[str, Any]) -> PretrainedConfig:
    """`fields` as the family's config; fields a strict config refuses are dropped one by one (the first
    refusal that is not about a known field is raised)."""
    fields = dict(fields)
    for _ in range(len(fields)):
        try:
            return AutoConfig.for_model(family, **fields)
        except Exception as exc:  # transformers' strict dataclasses name the field they refuse
            text = str(exc)
            bad = next((name for name in fields if f"'{name}'" in text and name in _COMMON), None)
            if bad is None:
                raise
            del fields[bad]
    raise ValueError(f"no tiny config of {family} could be built")


def _distinctive(family: str, config: PretrainedConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """Changes that give the tiny config what the family's own config has and small sizes lose: every
    per-layer type of the default config (`layer_kinds.TYPE_LISTS`, cycled over enough layers), and a sparse
    layer where the dense-first layers would cover all of them. Fields set by `OVERRIDES` or `changes`
    stay."""
    text = config.get_text_config(decoder=True)
    default = AutoConfig.for_model(family).get_text_config(decoder=True)
    more: dict[str, Any] = {}
    for name in TYPE_LISTS:
        want = list(dict.fromkeys(str(t) for t in getattr(default, name, None) or ()))
        have = {str(t) for t in getattr(text, name, None) or ()}
        if name not in fields and want and not set(want) <= have:
            more[name] = want
    layers = max([int(getattr(text, "num_hidden_layers", 2) or 2), *(len(v) for v in more.values())])
    if more:
        more = {name: (kinds * layers)[:layers] for name, kinds in more.items()}
        more["num_hidden_layers"] = layers
    dense = getattr(text, "mlp_only_layers", None)
    if "mlp_only_layers" not in fields and dense and set(range(layers)) <= set(dense):
        more.update(mlp_only_layers=[0], num_hidden_layers=max(layers, 2))
    first = getattr(text, "first_k_dense_replace", None)
    if "first_k_dense_replace" not in fields and isinstance(first, int) and first >= layers:
        more.update(first_k_dense_replace=max(layers, 2) - 1, num_hidden_layers=max(layers, 2))
    return more


def _short_windows(config: PretrainedConfig, fields: dict[str, Any]) -> PretrainedConfig:
    """The text config's sliding window and attention chunk set to `SHORT` (on the text config itself,
    which a composite config nests), unless `OVERRIDES` or `changes` set them."""
    text = config.get_text_config(decoder=True)
    for name in ("sliding_window", "attention_chunk_size"):
        size = getattr(text, name, None)
        if name not in fields and isinstance(size, int) and size > SHORT:
            setattr(text, name, SHORT)
    return config
