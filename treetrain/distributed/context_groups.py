"""Context groups: the world of ranks as data-parallel groups x C ranks that share each tree's resident state.

Why: a prompt whose resident state does not fit one device is held by a context group of C ranks
(`distributed.context_parallel`), each unit's KV on one of them (docs/distributed.md, context groups).
The groups are consecutive ranks, `[g * C, (g + 1) * C)`, so that on a node of 8 devices a group of up to
8 stays on one node's fast links; data-parallel group g is the trees' placement rank. Every rank creates
every group, in the same order, as torch.distributed requires. ZeRO and its gradient reduction stay over
the whole world: each rank's gradient is a partial sum of its group's, and the world's sum is the total.

Example (under torchrun, after the process group is initialised):
    >>> backend = join_context_group(DeepSpeedBackend(model, zero_stage=3), 2)   # doctest: +SKIP
    >>> backend.context.size, backend.context_size                               # doctest: +SKIP
    (2, 2)
"""

from __future__ import annotations

import torch.distributed as dist

from treetrain.distributed.backend import TrainBackend
from treetrain.errors import ConfigError
from treetrain.models.context_exchange import ContextExchange


def check_context_size(size: int, world_size: int) -> None:
    """A clear error unless `size` ranks per context group divide the world."""
    if size < 1:
        raise ConfigError(f"distributed.context_parallel must be >= 1, got {size}")
    if world_size % size:
        raise ConfigError(
            f"distributed.context_parallel={size} does not divide the world of {world_size} ranks "
            "(the world is data-parallel groups x context groups)"
        )


def context_exchange(rank: int, world_size: int, size: int) -> ContextExchange | None:
    """This rank's context group of `size` consecutive ranks (None for size 1). A collective: every rank
    of the default process group must call it with the same `size`."""
    check_context_size(size, world_size)
    if size == 1:
        return None
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world_size // size)]
    return ContextExchange(size, rank % size, groups[rank // size])


def join_context_group(backend: TrainBackend, size: int) -> TrainBackend:
    """`backend` with its context group of `size` ranks (`TrainBackend.context`); the same backend back."""
    backend.context = context_exchange(backend.rank, backend.world_size, size)
    return backend
