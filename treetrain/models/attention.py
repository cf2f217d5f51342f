"""Grouped-query attention against resident KV without expanding the past to every query head.

Why: with a past, a forward needs an explicit causal mask, and Hugging Face's `sdpa` path then expands the
keys and values to every query head (`repeat_kv`) before calling `scaled_dot_product_attention`. Against a
long resident past that expansion, kept for backward, is the largest buffer of a replay step: (query heads
÷ KV heads) copies of the whole past per layer. On CPU, torch's SDPA takes grouped-query inputs with a mask
directly (`enable_gqa=True`), so `engine_attention` routes the engine's forwards there. On CUDA a mask with
`enable_gqa` would fall back to the math kernel, so there, and for `eager`, the model's own path runs.

Example:
    >>> with engine_attention(model):                                   # doctest: +SKIP
    ...     out = model.model(input_ids=ids, position_ids=pos, cache=cache)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils.import_utils import is_torch_greater_or_equal

NAME = "treetrain_sdpa"
_GQA = is_torch_greater_or_equal("2.5")  # SDPA's `enable_gqa`


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,  # [B, H_kv, S, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's `sdpa` attention, with grouped-query heads passed to SDPA as they are (CPU only)."""
    plain = query.device.type != "cpu" or not _GQA or kwargs.get("position_bias") is not None
    if plain or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )  # fmt: skip
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and causal),
        enable_gqa=key.shape[1] != query.shape[1],
    )  # fmt: skip  # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, D]


def _register() -> None:
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, gqa_sdpa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def engine_attention(model: PreTrainedModel) -> Iterator[None]:
    """Run `model` with `gqa_sdpa_forward` while the block lasts, when it is configured for `sdpa`."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    _register()
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
