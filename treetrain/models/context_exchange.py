"""The collectives of one context group: what crosses ranks when a tree's resident past is sharded.

Why: a context group of C ranks holds one tree's resident KV between them, each piece on one rank
(`treetrain.replay.context_shards`). Every rank of the group runs the same units in lockstep, and computes
everything sized by the queries (embeddings, projections, MLPs, the rows' own keys, recurrent mixers)
identically; only attention against the resident past is split, each rank over the pieces it holds. By the
log-sum-exp merge of attention states (`treetrain.models.attention_states`), a piece held elsewhere is one
more key set, so per attention layer:

- forward: each rank's partial state over its pieces, `(out, lse)`, is all-gathered over the group and
  merged in rank order, so the layer's output is the same on every rank, bit for bit;
- backward: each rank's gradient of the output is a partial sum of the true one (see below), so it is
  all-reduced (summed) over the group; the true gradient gives each held piece its dK and dV (added into
  its G accumulator, where the piece lives) and this rank's share of dQ. The resident KV never moves.

Exactness is linearity: the group's ranks hold the same values, so the sum over ranks of what each
backpropagates is the backward of the summed upstream gradient. A rank's loss is the step's loss divided
by C; only ⟨KV, G⟩ of a piece it holds (`exact`'s close) is its own alone. The data-parallel reduction
over the whole world then sums the ranks' partial parameter gradients to the exact total.

What crosses ranks is sized by the queries of the running step, never by the past: `ExchangeCounts`
keeps the bytes each rank contributes (the planner's ledger and the benchmark report them).

Lockstep is also checked, not assumed: before each replay (`TreeReplay.accumulate`) the ranks `agree` on
what they are about to run (the model and adapter versions, the trees, the replay settings and each rank's
schedule). A rank holding a stale shard (an older version), other trees or another plan would otherwise
merge attention states that belong to different queries, silently, whenever the shapes happen to match.

Example (inside an initialised process group, every rank of `group` running the same code):
    >>> exchange = ContextExchange(size=2, rank=dist.get_rank(), group=group)   # doctest: +SKIP
    >>> states = exchange.gather_state(out, lse)                                 # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from treetrain.errors import TreetrainError
from treetrain.models.attention_states import merge_into


class GroupMismatchError(TreetrainError):
    """The ranks of a context group are not about to replay the same thing (one line, naming what and who)."""


@dataclass(frozen=True)
class ExchangeCounts:
    """What one rank put into its group's collectives since the counts were last reset."""

    gathered_bytes: int = 0
    """Bytes of partial attention states `(out, lse)` this rank contributed to all-gathers (forward)."""
    reduced_bytes: int = 0
    """Bytes of output gradients this rank contributed to all-reduces (backward)."""
    gathers: int = 0
    reduces: int = 0

    @property
    def total_bytes(self) -> int:
        return self.gathered_bytes + self.reduced_bytes


class ContextExchange:
    """Collectives over one context group of `size` ranks; this process is `rank` (0 .. size-1) in it.

    `group` is the torch.distributed process group of exactly those ranks (None: the default group, which
    must then have `size` ranks). Every rank of the group must call the same collectives in the same order:
    the engine guarantees it by running the group's units in lockstep.
    """

    def __init__(self, size: int, rank: int, group: dist.ProcessGroup | None = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"context exchange: rank {rank} is not in a group of {size}")
        self.size, self.rank, self.group = size, rank, group
        self.counts = ExchangeCounts()

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def reset_counts(self) -> ExchangeCounts:
        """The counts so far, and zero them."""
        counts, self.counts = self.counts, ExchangeCounts()
        return counts

    def gather_state(self, out: torch.Tensor, lse: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's partial attention state `(out [..., Dv], lse [...])`, in rank order (one all-gather
        of both, packed). Rows a rank saw no key for carry `lse = -inf` and `out = 0`."""
        packed = torch.cat([out, lse[..., None].to(out.dtype)], dim=-1).contiguous()
        parts = [torch.empty_like(packed) for _ in range(self.size)]
        dist.all_gather(parts, packed, group=self.group)
        c = self.counts
        self.counts = ExchangeCounts(
            c.gathered_bytes + packed.numel() * packed.element_size(),
            c.reduced_bytes,
            c.gathers + 1,
            c.reduces,
        )
        return [(p[..., :-1], p[..., -1].to(lse.dtype)) for p in parts]

    def agree(self, what: str, values: Sequence[int], device: torch.device | str = "cpu") -> None:
        """`GroupMismatchError` unless every rank of the group passes the same `values` (one all-gather of
        `len(values)` integers on `device`, which NCCL needs on the GPU). Not in `counts`: those are the
        attention exchange's bytes, which the ledger predicts to the byte."""
        mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        for other, theirs in enumerate(parts):
            if not torch.equal(theirs, mine):
                raise GroupMismatchError(
                    f"context group: rank {other} of the group holds {what} {theirs.tolist()} and rank "
                    f"{self.rank} holds {mine.tolist()}; every rank of a group must replay the same trees "
                    "with the same weights (a stale shard or a placement that split the group)"
                )

    def all_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """The sum over the group of `grad` (a new tensor of its dtype; reduced in at least float32)."""
        work = grad.to(torch.promote_types(grad.dtype, torch.float32)).contiguous().clone()
        dist.all_reduce(work, op=dist.ReduceOp.SUM, group=self.group)
        c = self.counts
        self.counts = ExchangeCounts(
            c.gathered_bytes, c.reduced_bytes + work.numel() * work.element_size(), c.gathers, c.reduces + 1
        )
        return work.to(grad.dtype)


def merge_group(
    exchange: ContextExchange,
    out: torch.Tensor,  # [..., Dv], the state over the rows' own keys (finite lse in every row)
    lse: torch.Tensor,
    past: tuple[torch.Tensor, torch.Tensor] | None,  # this rank's state over the pieces it holds
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` merged with every rank's state over its pieces, in rank order: the same on every rank."""
    if past is None:
        past = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    for part_out, part_lse in exchange.gather_state(past[0].to(out.dtype), past[1].to(lse.dtype)):
        out, lse = merge_into(out, lse, part_out, part_lse)
    return out, lse
