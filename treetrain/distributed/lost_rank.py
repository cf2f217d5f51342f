"""Whether an error means another rank of the run is gone, so that `treetrain train` can say so in one
line and point at `--resume` instead of showing a bug's traceback.

A rank that dies (killed, out of host memory, its machine lost) leaves the others inside a collective.
Under `torchrun` on one node the launcher stops them with SIGTERM (`treetrain.cli.termination`); across
nodes, or before the launcher acts, the collective itself fails: gloo raises a `RuntimeError` naming the
closed connection, NCCL a `torch.distributed.DistError`. Nothing is lost either way: the update in flight
never reached a checkpoint, and `--resume` redoes it.

Example:
    >>> gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:8102")
    >>> lost_rank(gone) is gone, lost_rank(RuntimeError("shape mismatch"))
    (True, None)
"""

from __future__ import annotations

import re

import torch.distributed as dist

PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout")
"""What gloo's transport says when the rank at the other end of a pair is gone."""


def lost_rank(exc: BaseException) -> BaseException | None:
    """The failed collective behind `exc` (itself, or what it was raised from) when another rank is gone;
    else None."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        text = str(at)
        if isinstance(at, dist.DistError) or (
            isinstance(at, RuntimeError) and "gloo" in text and any(s in text for s in PEER_GONE)
        ):
            return at
        at = at.__cause__ or at.__context__
    return None


def lost_rank_line(exc: BaseException, run_dir: str) -> str:
    """The one line for a collective that `lost_rank` found: its first sentence, without the source
    location gloo puts first, and how to go on.

    >>> lost_rank_line(RuntimeError("[gloo/pair.cc:553] Connection closed by peer [::1]:80. Check logs."), "r")
    'another rank of this run stopped, so this one did (Connection closed by peer [::1]:80); the update in flight was not kept: continue with --resume --run-dir r'
    """
    text = str(exc).strip()
    said = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(exc).__name__)
    said = said.split(". ")[0].rstrip(".")[:300]
    return (
        f"another rank of this run stopped, so this one did ({said}); the update in flight was not "
        f"kept: continue with --resume --run-dir {run_dir}"
    )
