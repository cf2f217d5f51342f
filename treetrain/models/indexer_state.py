"""The indexer keys of indexed sparse attention (DeepSeek V3.2, GLM-5, AXK2), resident beside the latents.

Why: a DSA layer's indexer scores every earlier position with keys of its own (`wk`, a LayerNorm and RoPE
over the hidden states), `[B, T, D_index]`, which Hugging Face keeps in the cache beside the MLA latents
(`DynamicIndexedLayer.indexer_keys`, written by `cache.update_indexer`). Each query then attends to the
`index_topk` positions of the highest index score among all earlier ones, past and own together. A suffix
replayed against a resident past selects exactly what the flat forward selects only if those keys of the
past are there: so a unit keeps them as one more resident tensor (`IndexedEntry.index_keys`,
`[1, 1, P, D_index]`), and a forward continuing a past puts them into an indexed cache layer ahead of the
rows' own (`indexed_cache`), then the model's own indexer scores and selects over the whole. The indexer runs
under `no_grad` (its top-k is discrete), so the keys take no G. The layer folds its selection into the
attention mask it builds itself, which shared-past attention, masking by position alone, does not read: an
indexed model takes the concatenated past (`INDEXED_REASON`).

Only top-k indexers over per-token keys are of this kind (a module with `index_topk` that calls
`update_indexer`); an indexer that selects otherwise (Qwen4-Exp's QSA pools its keys into blocks and keeps the
past's positions in its cache) is refused by the support check with `other_indexer_reason`.

Example:
    >>> from transformers import AutoModelForCausalLM
    >>> from treetrain.models.tiny_family import tiny_family_config
    >>> model = AutoModelForCausalLM.from_config(tiny_family_config("deepseek_v32"))
    >>> sorted(indexed_layers(model)), index_key_bytes_per_token(model)  # 2 layers x 8 float32 channels
    ([0, 1], 64)
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer

from treetrain.models.layer_entry import IndexedEntry, LayerEntry

#: Why an indexed model's attention reads the concatenated past (`shared_past_reason`).
INDEXED_REASON = (
    "its indexer picks each query's keys (indexed sparse attention) and the layer masks the rest itself, "
    "which shared-past attention does not reproduce"
)
_UPDATE = "update_indexer"
_CALLS: dict[type, bool] = {}
_FOUND: weakref.WeakKeyDictionary[nn.Module, tuple[frozenset[int], frozenset[int], int]] = (
    weakref.WeakKeyDictionary()
)


def _calls_update(cls: type) -> bool:
    """Whether `cls.forward` writes keys into the cache's indexer store."""
    if cls not in _CALLS:
        try:
            _CALLS[cls] = _UPDATE in inspect.getsource(cls.forward)  # type: ignore[attr-defined]
        except (OSError, TypeError, AttributeError):
            _CALLS[cls] = False
    return _CALLS[cls]


def _scan(model: nn.Module) -> tuple[frozenset[int], frozenset[int], int]:
    """(layers with a top-k indexer, layers with another indexer, index key elements per token)."""
    if model not in _FOUND:
        top_k: set[int] = set()
        other: set[int] = set()
        width = 0
        for m in model.modules():
            layer = getattr(m, "layer_idx", None)
            if not isinstance(layer, int) or not _calls_update(type(m)):
                continue
            if isinstance(getattr(m, "index_topk", None), int):
                top_k.add(layer)
                width += int(getattr(m, "head_dim", 0) or 0)
            else:
                other.add(layer)
        _FOUND[model] = (frozenset(top_k), frozenset(other), width)
    return _FOUND[model]


def indexed_layers(model: nn.Module) -> frozenset[int]:
    """The cache indices whose layer runs a top-k indexer over per-token keys (a GLM-5 layer that reuses the
    previous layer's selection, `indexer_types` "shared", runs none and keeps no indexer keys)."""
    return _scan(model)[0]


def other_indexer_reason(model: nn.Module) -> str | None:
    """Why the model's indexers are not of the kind the engine keeps resident, or None."""
    other = _scan(model)[1]
    if not other:
        return None
    return (
        f"the indexer of layers {sorted(other)} is not a top k over per-token index keys (Qwen4-Exp's QSA pools "
        "its keys into blocks and reads the past's positions from its cache, `indexer_position_ids`); the engine "
        "keeps only a top-k indexer's keys resident"
    )


def index_key_bytes_per_token(model: nn.Module) -> int:
    """Resident bytes of one token's indexer keys, every indexed layer's together, in the model's dtype."""
    width = _scan(model)[2]
    return width * next(model.parameters()).element_size() if width else 0


def indexed_cache(
    model: nn.Module,
    n_layers: int,
    past: Sequence[Sequence[LayerEntry]] | None,
    rows: int,
) -> DynamicCache:
    """An empty cache whose indexed layers are `DynamicIndexedLayer`s holding the past's indexer keys
    (`past`: per piece, root side first, per layer; each piece's `[1, 1, P_i, D]` concatenated and
    broadcast to the `rows`). The caller writes the past's KV into it as for any model."""
    indexed = indexed_layers(model)
    cache = DynamicCache()
    cache.layers = [DynamicIndexedLayer() if i in indexed else DynamicLayer() for i in range(n_layers)]
    for i in sorted(indexed):
        parts = [e.index_keys for p in past or () if isinstance(e := p[i], IndexedEntry)]
        if not parts:
            continue
        keys = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)  # [1, 1, P, D]
        layer = cache.layers[i]
        assert isinstance(layer, DynamicIndexedLayer)
        layer.update_indexer(keys[:, 0].expand(rows, -1, -1))  # [rows, P, D]
    return cache


def own_index_keys(model: nn.Module, cache: DynamicCache, past_length: int) -> Mapping[int, torch.Tensor]:
    """The indexer keys the forward wrote for its own tokens, per indexed layer, `[B, 1, T, D]`."""
    out: dict[int, torch.Tensor] = {}
    for i in sorted(indexed_layers(model)):
        layer = cache.layers[i] if i < len(cache.layers) else None
        keys = getattr(layer, "indexer_keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 3:
            out[i] = keys[:, None, past_length:]
    return out
