"""Caches for batched decoding: KV that grows in place, and rows of different lengths in one padded cache.

The `hf` engine (`treetrain.rollout.engines.hf_engine`) keeps one cache for every live row. `GrowingLayer` makes a
decode step cost the new token, not a copy of the cache; the helpers pad, join and measure caches.

Example:
    >>> import torch
    >>> layer = GrowingLayer()
    >>> k = torch.zeros(2, 1, 3, 4)
    >>> _ = layer.update(k, k)
    >>> keys, _ = layer.update(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4))
    >>> tuple(keys.shape), float(keys[0, 0, -1, 0])
    ((2, 1, 4, 4), 1.0)
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that writes new KV into spare capacity instead of concatenating: a decode step of a
    large batch costs the size of the new token, not a copy of the whole cache."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.get_seq_length(), key_states.shape[-2]
        buf: tuple[torch.Tensor, torch.Tensor] | None = getattr(self, "_buf", None)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        if (
            buf is None
            or buf[0].data_ptr() != keys.data_ptr()  # batch_select / repeat made new tensors
            or buf[0].shape[0] != key_states.shape[0]
            or n + q > buf[0].shape[-2]
        ):
            capacity = max(2 * (n + q), 64)
            bk = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1])
            bv = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1])
            if n:
                bk[:, :, :n], bv[:, :, :n] = keys, values
            buf = self._buf = (bk, bv)
        bk, bv = buf
        bk[:, :, n : n + q], bv[:, :, n : n + q] = key_states, value_states
        self.keys, self.values = bk[:, :, : n + q], bv[:, :, : n + q]
        return self.keys, self.values


def mergeable(cache: Any) -> bool:
    return bool(cache.layers) and all(isinstance(layer, GrowingLayer) for layer in cache.layers)


def new_cache(model: Any) -> Any:
    """An empty cache for `model`; plain full-attention layers become `GrowingLayer`s."""
    cache = DynamicCache(config=model.config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def layers_of(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def with_room(
    model: Any,
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]],
    width: int,
    index: torch.Tensor | None = None,
) -> Any:
    """A cache of `model` (plain attention layers) whose rows are those of `parts` (per part, per layer
    `(k, v)` `[R_i, H, W_i, D]`) stacked and left-padded with zeros to `width`, then reordered by `index`
    (rows of the stack) when given: each layer's KV is copied once, straight into a buffer with growth room.

    >>> k = torch.ones(1, 1, 2, 4)
    >>> cache = with_room(None, [[(k, k)], [(k[:, :, :1], k[:, :, :1])]], 2)
    >>> cache.layers[0].keys[:, 0, :, 0].tolist(), cache_bytes(cache)
    ([[1.0, 1.0], [0.0, 1.0]], 4096)
    """
    layers = []
    for layer_parts in zip(*parts, strict=True):
        rows = sum(k.shape[0] for k, _ in layer_parts)
        out = []
        for which in (0, 1):
            x0 = layer_parts[0][which]
            n = rows if index is None else len(index)
            buf = x0.new_empty(n, x0.shape[1], max(2 * width, 64), x0.shape[3])
            if index is not None and len(layer_parts) == 1 and x0.shape[2] == width:  # a reorder alone
                torch.index_select(x0, 0, index, out=buf[:, :, :width])
                out.append(buf)
                continue
            stacked = buf if index is None else x0.new_empty(rows, x0.shape[1], width, x0.shape[3])
            at = 0
            for kv in layer_parts:
                x = kv[which]
                pad = width - x.shape[2]
                stacked[at : at + x.shape[0], :, :pad] = 0  # padding is masked, but read: never garbage
                stacked[at : at + x.shape[0], :, pad:width] = x
                at += x.shape[0]
            if index is not None:
                torch.index_select(stacked, 0, index, out=buf[:, :, :width])
            out.append(buf)
        layer = GrowingLayer()
        layer.lazy_initialization(out[0][:, :, :0], out[1][:, :, :0])
        layer._buf = (out[0], out[1])
        layer.keys, layer.values = out[0][:, :, :width], out[1][:, :, :width]
        layers.append(layer)
    cache = new_cache(model) if model is not None else DynamicCache()
    cache.layers = layers
    return cache


def adopt(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A cache of `model` (plain attention layers) holding `layers`' tensors themselves: no copy and no spare
    room, for KV that is read rather than grown (a kept prefix; the first `update` reserves room).

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
    ...     num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1))
    >>> k = torch.zeros(1, 1, 3, 8)
    >>> cache = adopt(model, [(k, k)])
    >>> cache.layers[0].keys is k, cache.get_seq_length(), cache_bytes(cache)
    (True, 3, 96)
    """
    cache = new_cache(model)
    for layer, (keys, values) in zip(cache.layers, layers, strict=True):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


def mask_left(mask: torch.Tensor, width: int) -> torch.Tensor:  # [R, L] -> [R, width]
    extra = width - mask.shape[1]
    return mask if extra == 0 else torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)


def compact(cache: Any) -> Any:
    """`cache` with each growing layer's spare capacity given back (a kept prefix is read, not grown: a
    child that extends it reserves its own room)."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer) and layer.keys is not None and layer.values is not None:
            layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            vars(layer).pop("_buf", None)
    return cache


def cache_bytes(cache: Any) -> int:
    """Bytes `cache` holds, counted from its tensors' storage: a growing layer's spare capacity counts, and
    a storage two tensors view is counted once.

    >>> layer = GrowingLayer()
    >>> _ = layer.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))
    >>> cache = DynamicCache()
    >>> cache.layers = [layer]
    >>> cache_bytes(cache), cache_bytes(compact(cache))  # 64 reserved positions, then the 3 used
    (2048, 96)
    """
    seen: dict[int, int] = {}
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            tensors += list(states.values())
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def token_kv_bytes(model: Any) -> int:
    """KV bytes one token of one row takes in `model`'s cache (keys and values of every layer), from its
    config; an estimate for caches that are not plain attention KV."""
    config = model.config.get_text_config(decoder=True)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or int(getattr(config, "hidden_size", heads)) // heads
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    itemsize = next(model.parameters()).element_size()
    return max(1, 2 * layers * kv_heads * int(head_dim) * itemsize)
