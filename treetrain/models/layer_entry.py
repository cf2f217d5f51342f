"""One layer's resident entry: its KV, its recurrent state, both (`HybridEntry`), or KV and indexer keys.

Why: a unit keeps, per decoder layer, what that layer's later tokens read of its earlier ones. An attention
layer keeps `(keys, values)` (`[1, H_kv, P, D]` each); a recurrent layer keeps `(conv state, recurrent
state)` before the unit's last token (`treetrain.models.recurrent_state`); a layer that attends *and* runs a
recurrent mixer (Zamba 2's and Zamba's hybrid layers: a shared transformer block, then a Mamba-2 or Mamba
mixer; Falcon-H1's parallel attention and Mamba-2) keeps both, as one `HybridEntry`. A layer of indexed
sparse attention (DeepSeek V3.2, GLM-5, AXK2) keeps its KV and its indexer's keys, as one `IndexedEntry`
(`treetrain.models.indexer_state`). Everything that stores, evicts, offloads, sizes or accumulates G on an
entry does it through the functions here, so none of it guesses a layout from a tuple's length. A G
accumulator has the structure of its entry's differentiable part (`grad_zeros`): a `HybridEntry`
accumulates into the KV part and into the state part; an `IndexedEntry` into its KV only, since the indexer
runs without gradient (its top-k is discrete).

Example:
    >>> import torch
    >>> kv = (torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
    >>> state = (torch.zeros(1, 6, 3), torch.zeros(1, 2, 4, 8))
    >>> entry = HybridEntry(kv, state)
    >>> entry_bytes([kv, entry]) == 2 * 160 + 2 * 160 + 72 + 256
    True
    >>> [tuple(t.shape) for t in entry_tensors(map_entry(lambda t: t[:, :, :2] if t.dim() == 4 else t, kv))]
    [(1, 2, 2, 4), (1, 2, 2, 4)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

#: Per-layer (keys, values), each `[B, H_kv, T, D]`; for a recurrent layer (conv state `[B, C, kernel - 1]`,
#: recurrent state).
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class HybridEntry:
    """The entry of a layer with attention and a recurrent mixer: KV over the unit's positions, and the
    mixer's (conv state, recurrent state) before the unit's last token."""

    kv: LayerKV
    """Keys and values `[B, H_kv, T, D]`, with a sequence axis like any attention layer's."""
    state: LayerKV
    """Conv window `[B, C, kernel - 1]` and recurrent state (no sequence axis), read only by children."""


@dataclass(frozen=True)
class IndexedEntry:
    """The entry of a layer of indexed sparse attention: KV (MLA latents) over the unit's positions, and the
    keys its indexer scores each later query against to pick that query's top k."""

    kv: LayerKV
    """Keys and values `[B, H_kv, T, D]` (the latents `[B, 1, T, r]`, `[B, 1, T, R]` under MLA)."""
    index_keys: torch.Tensor
    """The indexer's keys `[B, 1, T, D_index]`: one head, the sequence axis where KV has it."""


#: What one layer of a unit keeps resident.
LayerEntry = LayerKV | HybridEntry | IndexedEntry


def entry_tensors(entry: LayerEntry) -> tuple[torch.Tensor, ...]:
    """The entry's tensors in a fixed order (KV first): what is stored and sized."""
    if isinstance(entry, HybridEntry):
        return (*entry.kv, *entry.state)
    if isinstance(entry, IndexedEntry):
        return (*entry.kv, entry.index_keys)
    return entry


def grad_tensors(entry: LayerEntry) -> tuple[torch.Tensor, ...]:
    """The tensors of the entry a G accumulator pairs with, in `entry_tensors`' order: all but indexer keys."""
    return entry_tensors(entry.kv if isinstance(entry, IndexedEntry) else entry)


def grad_zeros(entry: LayerEntry) -> LayerEntry:
    """A zero G accumulator for `entry`: its structure without the indexer keys, which take no gradient."""
    return map_entry(torch.zeros_like, entry.kv if isinstance(entry, IndexedEntry) else entry)


def map_entry(fn: Callable[[torch.Tensor], torch.Tensor], entry: LayerEntry) -> LayerEntry:
    """The same structure with `fn` applied to every tensor (detach, clone, a move to another device)."""
    if isinstance(entry, HybridEntry):
        return HybridEntry((fn(entry.kv[0]), fn(entry.kv[1])), (fn(entry.state[0]), fn(entry.state[1])))
    if isinstance(entry, IndexedEntry):
        return IndexedEntry((fn(entry.kv[0]), fn(entry.kv[1])), fn(entry.index_keys))
    return fn(entry[0]), fn(entry[1])


def map_kv(fn: Callable[[torch.Tensor], torch.Tensor], entry: LayerEntry) -> LayerEntry:
    """`fn` applied to the parts with a sequence axis: KV and indexer keys (a hybrid's state stays)."""
    if isinstance(entry, HybridEntry):
        return HybridEntry((fn(entry.kv[0]), fn(entry.kv[1])), entry.state)
    return map_entry(fn, entry)


def kv_part(entry: LayerEntry) -> LayerKV:
    """What attention reads: a hybrid's or an indexed layer's KV, or the pair itself."""
    return entry.kv if isinstance(entry, (HybridEntry, IndexedEntry)) else entry


def state_part(entry: LayerEntry) -> LayerKV:
    """What a recurrent mixer reads: a hybrid's (conv, recurrent) state, or the pair itself."""
    if isinstance(entry, IndexedEntry):
        raise TypeError("an indexed attention layer's entry holds no recurrent state")
    return entry.state if isinstance(entry, HybridEntry) else entry


def entry_bytes(entries: Iterable[LayerEntry]) -> int:
    """Bytes of the tensors of `entries`, every part counted; a part on the `meta` device (KV another rank
    of a context group holds: `treetrain.replay.context_replay`) has no storage and counts nothing."""
    return sum(t.numel() * t.element_size() for e in entries for t in entry_tensors(e) if not t.is_meta)
