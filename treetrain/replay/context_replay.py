"""A tree's resident state over a context group: which units this rank holds, and what it keeps of the rest.

Why: with `distributed.context_parallel: C > 1` the C ranks of a context group replay the same trees with
the same plan, in lockstep, and hold each unit's KV on one rank only, its owner
(`treetrain.replay.context_shards`: zigzag position blocks of the plan's chunk size, by the unit's first
position). A unit held elsewhere keeps its KV here as tensors on the `meta` device: shapes (so positions
and lengths stay known) and no storage, never read. Its G accumulators are `meta` too. What every rank
keeps of every unit is what has no sequence axis: a recurrent layer's constant-size state (and a hybrid
layer's state part), computed by every rank of the group alike. Attention against a piece held elsewhere
runs on its owner (`treetrain.models.context_exchange`).

Exactness: every rank computes the same forward, so the group's update is the sum of the ranks' backward
passes when each rank's share of the loss is 1/C (`loss_share`) and ⟨KV, G⟩ of a unit's recompute pairs
each G part with the rank that holds it: the KV part on its owner, in full; the state parts on every rank,
each holding its partial sum.

Example:
    >>> from treetrain.models.context_exchange import ContextExchange
    >>> shards = ContextShards.of(ContextExchange(size=2, rank=1), chunk_size=4)
    >>> shards.group.owns(4), shards.loss_share
    (True, 0.5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treetrain.errors import TreetrainError
from treetrain.models.attention import shared_past_reason
from treetrain.models.context_exchange import ContextExchange
from treetrain.models.indexer_state import INDEXED_REASON
from treetrain.models.layer_entry import HybridEntry, IndexedEntry, LayerEntry
from treetrain.models.lora import unwrap
from treetrain.replay.context_shards import ContextGroup
from treetrain.replay.resident import ResidentStore


class ContextShardingError(TreetrainError, ValueError):
    """A model or setting that a context group cannot shard (refused before any compute)."""


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@dataclass(frozen=True)
class ContextShards:
    """This rank's context group (`group`: who owns which position) and its collectives (`exchange`)."""

    group: ContextGroup
    exchange: ContextExchange

    @staticmethod
    def of(exchange: ContextExchange, chunk_size: int | None) -> ContextShards:
        """The shards of `exchange`'s group, blocks of `chunk_size` positions (the plan's chunk size: each
        chunk of a long node is one block; 1 when nodes are never split)."""
        return ContextShards(ContextGroup(exchange.size, exchange.rank, max(1, chunk_size or 1)), exchange)

    @staticmethod
    def of_store(
        store: ResidentStore, chunk_size: int | None, model: PreTrainedModel
    ) -> ContextShards | None:
        """The shards of `store`'s context group for a replay of `model` (None without a sharded group);
        `ContextShardingError` with the reason for a model whose past cannot be split by key set."""
        exchange = store.exchange
        if exchange is None or not exchange.sharded:
            return None
        require_shardable(model)
        return ContextShards.of(exchange, chunk_size)

    def crossed(self) -> int:
        """Bytes this rank has put into its group's collectives so far."""
        return self.exchange.counts.total_bytes

    @property
    def loss_share(self) -> float:
        """Each rank's share of the loss terms every rank of the group computes alike."""
        return 1.0 / self.group.size

    def owns(self, offset: int) -> bool:
        """Whether this rank holds the unit whose first token sits at `offset`."""
        return self.group.owns(offset)

    def kept(self, entries: Sequence[LayerEntry], offset: int, recurrent: frozenset[int]) -> list[LayerEntry]:
        """What this rank keeps of a unit's entries: all of them when it owns the unit, else its layers'
        recurrent state only, the KV on the `meta` device."""
        if self.owns(offset):
            return list(entries)
        kept: list[LayerEntry] = []
        for i, e in enumerate(entries):
            if i in recurrent:
                kept.append(e)
            elif isinstance(e, HybridEntry):
                kept.append(HybridEntry((_meta(e.kv[0]), _meta(e.kv[1])), e.state))
            elif isinstance(e, IndexedEntry):
                raise ContextShardingError(f"a context group cannot shard this model: {INDEXED_REASON}")
            else:
                kept.append((_meta(e[0]), _meta(e[1])))
        return kept


def require_shardable(model: PreTrainedModel) -> None:
    """`ContextShardingError` with the reason when a context group cannot shard `model`'s resident past."""
    why = refusal(model)
    if why is not None:
        raise ContextShardingError(why)


def refusal(model: PreTrainedModel) -> str | None:
    """Why a context group cannot shard `model`'s resident past, or None. Sharding needs shared-past
    attention (the past read piece by piece, so a piece can be attended where it lives): a model whose
    attention takes the concatenated past cannot be sharded, nor indexed sparse attention (DeepSeek V3.2,
    GLM-5), whose indexer scores every earlier key to pick each query's top k."""
    reason = shared_past_reason(unwrap(model))
    if reason is None:
        return None
    return (
        f"distributed.context_parallel > 1 cannot shard {type(unwrap(model)).__name__}'s resident past: "
        f"{reason}; run it with context_parallel: 1"
    )
