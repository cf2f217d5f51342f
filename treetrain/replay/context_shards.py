"""Which rank of a context group holds a resident piece: the one rule the engine and the ledger share.

Why: a context group of C ranks holds one tree's resident state between them, each piece on one rank (its
*owner*), never replicated. The engine keeps a piece only on its owner, and the ledger prices each rank's
share; both must agree piece by piece, so the rule lives here, below both.

Pieces are owned by the position block of their first token. Blocks are dealt out zigzag (0, 1, ..., C-1,
C-1, ..., 1, 0, ...): a piece early in the context is attended by every later query and a late one by few,
so pairing block r with block 2C-1-r evens out the causal work as well as the bytes.

Example:
    >>> [block_owner(b, 2) for b in range(6)]
    [0, 1, 1, 0, 0, 1]
    >>> ContextGroup(size=2, rank=1, block=4).owns(position=5)
    True
"""

from __future__ import annotations

from dataclasses import dataclass


def block_owner(block: int, size: int) -> int:
    """The rank (0 .. size-1) that owns position block `block` under the zigzag deal."""
    if size < 1 or block < 0:
        raise ValueError(f"block_owner: need size >= 1 and block >= 0, got size={size}, block={block}")
    turn = block % (2 * size)
    return turn if turn < size else 2 * size - 1 - turn


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its context group (`distributed.context_parallel`)."""

    size: int = 1
    """C: how many ranks share one tree's resident state (1: no sharding, every piece is local)."""
    rank: int = 0
    """This rank's index inside the group, 0 .. size-1."""
    block: int = 0
    """Tokens per ownership block (the planner's chunk size); 0 with size 1."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"context group: rank {self.rank} is not in a group of {self.size}")
        if self.size > 1 and self.block < 1:
            raise ValueError(
                f"context group of {self.size} needs a block of at least 1 token, got {self.block}"
            )

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def owner(self, position: int) -> int:
        """The rank that holds the piece whose first token sits at `position`."""
        return 0 if self.size == 1 else block_owner(position // self.block, self.size)

    def owns(self, position: int) -> bool:
        return self.owner(position) == self.rank
