"""What one rank of a context group holds and sends: the per-rank share of resident state, and the transfers.

Why: with `ReplayConfig.context_parallel` = C > 1, C ranks hold one tree's resident state between them
(docs/long-context.md). Every rank runs the same steps; the query side is computed identically on each,
a resident piece (unit) is kept only on its owner (`treetrain.replay.context_shards`: zigzag position
blocks of the chunk size), each rank attends the queries to its own pieces, and at each attention layer
the partial (out, lse) of the queries over each rank's own pieces are gathered over the group and merged. The ledger books one rank's bytes, so it asks
this module four questions, each answered from the same ownership rule the engine uses:

- which units' KV (and so which G accumulators) this rank holds: `ContextShare.unit_bytes`; recurrent
  state is constant-size and kept on every rank;
- what its activations attend to: the queries of every event against the pieces it owns only
  (`ContextShare.local`), the rest arriving as partial outputs;
- the transfer buffers an event adds to the replay-temporary class: `ContextShare.buffers`;
- the bytes this rank sends to the others for an event: `ContextShare.sent` (by the ring algorithms), and
  what it puts into the collectives, as the engine counts it: `ContextShare.contributed`.

The transfer model, per attention layer and query token (the step's rows x width, padded as the engine
pads them):

- forward, whenever the queries have a resident past: an all_gather of (out, lse), one partial per rank:
  C x (out + lse) bytes received into a buffer, (C - 1) x (out + lse) sent in a ring all_gather;
- a forward with a graph (a replay step, a kept graph) keeps every layer's gathered partials for its
  backward (`SAVED_FOR_BACKWARD`); a forward without one holds a single layer's buffer at a time;
- backward of a graph (a replay step's, a kept graph's): an all_reduce of dO (`BACKWARD_ALL_REDUCE`), one
  layer at a time, in float32 at least, 2 (C - 1) / C of its bytes sent in a ring all_reduce; out + q bytes
  of buffer (the reduced dO and this rank's dQ, which never crosses: each rank backpropagates its pieces'
  share of it, a partial sum). Without loss targets (a prompt chunk) only the attention layers whose
  output reaches resident state run their backward (`QueryBytes.untargeted`): those below the last layer
  that keeps state of its own (KV, or a recurrent mixer's), and that layer's own attention when a recurrent
  mixer after it keeps state from its output (Zamba's hybrid layers). Layers that reuse an earlier layer's
  KV (Gemma 4's `num_kv_shared_layers`) attend, gather and reduce like any other, and keep nothing.

Example:
    >>> sizes = QueryBytes(layers=1, out=8, lse=1, query=8, grad=8, untargeted=0)
    >>> share = ContextShare(size=2, rank=1, block=4, sizes=sizes)
    >>> share.owns(5), share.owns(9), share.owns(12)
    (True, True, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from transformers import PreTrainedModel

from treetrain.memory.events import MemEvent, Shape, TreeLayout
from treetrain.models.decoder import decoder_layers
from treetrain.models.lora import unwrap
from treetrain.models.recurrent_state import mixer_after_attention, stateless_layers, unkeyed_layers
from treetrain.replay.context_shards import ContextGroup
from treetrain.replay.units import UnitTree

STATE_MIN_BYTES = 4
"""Partial attention states (out, lse) and output gradients cross in the merge's dtype, float32 at least
(`shared_past`'s running state, `ContextExchange.all_reduce`), whatever the model's dtype."""
SAVED_FOR_BACKWARD = True
"""A forward with a graph keeps every attention layer's gathered (out, lse) partials until its backward (the
merge's autograd saves them); an upper bound if the engine recomputes them instead."""
BACKWARD_ALL_REDUCE = ("dO",)
"""What a graph's backward all_reduces over the group at each attention layer: query-sized."""
GRAPH_KINDS = ("step", "keep")
WHOLE = 1 << 62
"""The ownership block of an unchunked plan: one block spans every position, so rank 0 owns every piece."""


@dataclass(frozen=True)
class QueryBytes:
    """Bytes of one query token's attention tensors, per attention layer, as the group holds and sends them."""

    layers: int
    """Attention layers: every layer that attends to the resident past (one that reuses another layer's KV
    included), each gathering its partial states and, in a backward with loss targets, reducing its dO."""
    out: int
    """A partial attention output of one token: heads x value head size, in the merge's dtype."""
    lse: int
    """Its log-sum-exp, packed beside it: one per head, in the merge's dtype."""
    query: int
    """Its query (the size of dQ): heads x query/key head size, in the model's dtype."""
    grad: int
    """Its output gradient dO as the group all-reduces it: heads x value head size, in the merge's dtype."""
    untargeted: int
    """Attention layers whose backward runs in a graph without loss targets (a prompt chunk's, kept for
    `exact`'s close), where gradient enters only through resident state: those whose output reaches a
    later layer's own state, or a recurrent mixer after it in its layer (`mixer_after_attention`)."""


def query_bytes(model: PreTrainedModel) -> QueryBytes:
    """`QueryBytes` of `model`, read off its config as `persistent.kv_bytes_per_token` reads the KV side."""
    config = model.config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    value_dim = int(getattr(config, "v_head_dim", None) or head_dim)
    query_dim = head_dim
    if getattr(config, "kv_lora_rank", None):  # multi-head latent attention: a no-rope and a rope part
        query_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
    size = next(model.parameters()).element_size()
    stat = max(size, STATE_MIN_BYTES)
    out = heads * value_dim * stat
    layers, untargeted = _attention_layers(model)
    return QueryBytes(layers, out, heads * stat, heads * query_dim * size, out, untargeted)


def _attention_layers(model: PreTrainedModel) -> tuple[int, int]:
    """(attention layers, those whose backward runs without loss targets): see `QueryBytes`."""
    bare = unwrap(model)
    config = bare.config.get_text_config(decoder=True)
    n = int(config.num_hidden_layers)
    shared = int(getattr(config, "num_kv_shared_layers", None) or 0)  # the top layers reuse earlier KV
    unkeyed, stateless = unkeyed_layers(bare), stateless_layers(bare)
    attention = [i for i in range(n) if i not in unkeyed]
    keeping = [i for i in range(n - shared) if i not in stateless]  # KV or recurrent state of its own
    if not keeping:
        return len(attention), 0
    last = keeping[-1]
    after = mixer_after_attention(bare, decoder_layers(bare))
    return len(attention), sum(1 for i in attention if i < last or (i == last and i in after))


@dataclass(frozen=True)
class ContextShare:
    """One rank's share of a context group's resident state, and its transfers (see module docstring)."""

    size: int
    rank: int
    block: int
    """Tokens per ownership block: the plan's chunk size (0 with no chunking: every piece on rank 0)."""
    sizes: QueryBytes

    @property
    def group(self) -> ContextGroup:
        """The engine's `ContextGroup`; with no chunking one block spans every position."""
        if self.size == 1:
            return ContextGroup()
        return ContextGroup(self.size, self.rank, self.block or WHOLE)

    def owns(self, position: int) -> bool:
        return self.group.owns(position)

    def unit_bytes(self, units: UnitTree, kv_per_token: int, state_per_unit: int) -> tuple[int, ...]:
        """Resident bytes of each unit on this rank: its KV where it owns the unit's first token, and the
        constant recurrent state everywhere."""
        group = self.group
        return tuple(
            (len(u) * kv_per_token if group.owns(u.offset) else 0) + state_per_unit for u in units.units
        )

    def local(self, units: UnitTree, ev: MemEvent) -> Shape:
        """`ev`'s shape as this rank computes it: its queries attend to (and, in `exact`, take dK/dV of) only
        the pieces of the past it owns; the other ranks' partial outputs arrive in the transfer buffers."""
        s = ev.shape
        if self.size == 1 or s.past == 0 or not ev.units:
            return s
        parent = units[ev.units[0]].parent
        path = units.path(parent) if parent is not None else ()
        total = sum(len(units[p]) for p in path)
        mine = [p for p in path if self.group.owns(units[p].offset)]
        owned = sum(len(units[p]) for p in mine)
        path_tokens = owned if s.path_tokens else 0
        fed = total - s.past if mine and mine[-1] == path[-1] else 0  # the overlap token is input, not past
        return replace(s, past=owned - fed, pieces=len(mine), path_tokens=path_tokens)

    def _per_layer(self, ev: MemEvent) -> tuple[int, int, int]:
        """(forward gather, backward buffer, backward all_reduce) bytes of one attention layer of `ev`; 0
        without a past."""
        s = ev.shape
        if self.size == 1 or s.past == 0 or s.rows == 0:
            return 0, 0, 0
        tokens = s.rows * s.width
        gather = (self.sizes.out + self.sizes.lse) * tokens
        if ev.kind not in GRAPH_KINDS:
            return gather, 0, 0
        backward = (self.sizes.out + self.sizes.query) * tokens if ev.kind == "step" else 0
        return gather, backward, self.sizes.grad * tokens

    def _reducing_layers(self, ev: MemEvent) -> int:
        """Attention layers whose backward runs for `ev`'s graph (each all-reduces its dO once)."""
        return self.sizes.layers if ev.shape.targets else self.sizes.untargeted

    def buffers(self, ev: MemEvent) -> int:
        """Replay-temporary bytes of `ev`'s transfer buffers at its peak."""
        gather, backward, _ = self._per_layer(ev)
        held = self.sizes.layers if SAVED_FOR_BACKWARD and ev.kind in GRAPH_KINDS else 1
        return self.size * gather * held + backward

    def contributed(self, ev: MemEvent) -> int:
        """Bytes this rank puts into its group's collectives for `ev`: its partial states gathered and its
        output gradients reduced, as the engine counts them (`ExchangeCounts.total_bytes`)."""
        gather, _, reduced = self._per_layer(ev)
        return gather * self.sizes.layers + reduced * self._reducing_layers(ev)

    def sent(self, ev: MemEvent) -> int:
        """Bytes this rank sends to the rest of its group for `ev` (ring all_gather and all_reduce)."""
        gather, _, reduced = self._per_layer(ev)
        reduced_sent = (2 * (self.size - 1) * reduced) // self.size
        return (self.size - 1) * gather * self.sizes.layers + reduced_sent * self._reducing_layers(ev)


def contributed_bytes(trees: Sequence[TreeLayout], size: int, block: int, model: PreTrainedModel) -> int:
    """Bytes one rank of a context group of `size` (ownership blocks of `block` positions) puts into its
    group's collectives replaying `trees`, its data group's share of an update laid out as the engine runs
    it: the prediction of `metrics.jsonl`'s `context_bytes`. Every rank of the group puts in the same."""
    if size == 1:
        return 0
    share = ContextShare(size, 0, block, query_bytes(model))
    return sum(share.contributed(ev) for tp in trees for ev in (*tp.events, *tp.reference_events))
