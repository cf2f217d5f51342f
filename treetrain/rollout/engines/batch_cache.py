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


def cache_of(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    cache = new_cache(model)
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def pad_left(x: torch.Tensor, width: int) -> torch.Tensor:  # [R, H, L, D] -> [R, H, width, D]
    extra = width - x.shape[-2]
    return x if extra == 0 else torch.cat([x.new_zeros(*x.shape[:-2], extra, x.shape[-1]), x], dim=-2)


def mask_left(mask: torch.Tensor, width: int) -> torch.Tensor:  # [R, L] -> [R, width]
    extra = width - mask.shape[1]
    return mask if extra == 0 else torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)


def cache_bytes(cache: Any) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            total += sum(t.numel() * t.element_size() for t in states.values() if isinstance(t, torch.Tensor))
    return total
