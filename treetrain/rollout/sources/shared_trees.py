"""Every rank's share of an update, shared: the collectives of the sampling sources.

With several ranks each samples every W-th task of an update, and the trees are exchanged (as tree-file
bytes) so that every rank enters the update window with the same groups, in task order. The environment
failures and step timeouts are shared the same way, so that every rank decides alike whether the run goes on
(`treetrain.rollout.sources.env_failures`). Each function here is a collective: every rank calls it, on the
training thread, through the backend's gather (`Ranks`).
"""

from __future__ import annotations

import base64
import json
import logging

from treetrain.rollout.sources.env_failures import (
    EnvironmentFailedError,
    share_failures,
    too_many,
    write_failures,
)
from treetrain.rollout.sources.produced import Produced
from treetrain.rollout.sources.run_settings import Ranks, RunSettings, task_seeds
from treetrain.rollout.tree_rollout import RolloutResult
from treetrain.tree import TrajectoryTree
from treetrain.tree.format import tree_from_bytes, tree_to_bytes

log = logging.getLogger(__name__)


def share_trees(
    ranks: Ranks, local: tuple[TrajectoryTree, ...], led: bool = False
) -> tuple[TrajectoryTree, ...]:
    """Every rank's trees, in task order (rank r sampled tasks r, r + W, ...); `led`: rank 0 sampled every
    task and the others none (an asynchronous run on a shared fleet of servers)."""
    if ranks.world_size == 1:
        return local
    payload = json.dumps([base64.b64encode(tree_to_bytes(t)).decode("ascii") for t in local])
    per_rank = [[tree_from_bytes(base64.b64decode(x)) for x in json.loads(p)] for p in ranks.gather(payload)]
    if led:
        return tuple(per_rank[0])
    total = sum(len(p) for p in per_rank)
    w = ranks.world_size
    return tuple(per_rank[i % w][i // w] for i in range(total))


def share_count(ranks: Ranks, local: int) -> int:
    """The sum of a count over every rank."""
    if ranks.world_size == 1:
        return local
    return sum(int(part) for part in ranks.gather(str(int(local))))


def share_servers(
    ranks: Ranks, rows: tuple[tuple[str, int, int, float], ...]
) -> tuple[tuple[str, int, int, float], ...]:
    """Each server's `(url, requests, samples, mean seconds queued)` over every rank's client: requests and
    samples summed, the queue time rank 0's (the server's own metrics count every client's requests)."""
    if ranks.world_size == 1:
        return rows
    queued = {url: q for url, _, _, q in rows}
    sent: dict[str, tuple[int, int]] = {}
    for part in ranks.gather(json.dumps(rows)):
        for url, requests, samples, q in json.loads(part):
            before = sent.get(url, (0, 0))
            sent[url] = (before[0] + int(requests), before[1] + int(samples))
            queued.setdefault(url, float(q))
    return tuple((url, n[0], n[1], queued[url]) for url, n in sent.items())


def gather_update(
    cfg: RunSettings, ranks: Ranks, update: int, result: RolloutResult, seconds: float, led: bool = False
) -> Produced:
    """Every rank's trees of `update` (a collective), its failures logged and written, and the run stopped
    when too many tasks failed (`rollout.max_failed_fraction`); `led`: rank 0 sampled every task."""
    r = cfg.rollout
    trees = share_trees(ranks, result.trees, led)
    lost = share_failures(ranks, write_failures(cfg.run_dir, update, ranks.rank, list(result.failures)))
    line = too_many(lost, len(task_seeds(cfg, update)), r.max_failed_fraction)
    if line is not None:
        raise EnvironmentFailedError(f"update {update}: {line}")
    for failure in lost:
        log.warning(
            "update %d: task seed %d dropped: %s (traceback in %s)",
            update, failure.seed, failure.error.line(), failure.log,
        )  # fmt: skip
    timeouts = share_count(ranks, result.step_timeouts)
    if timeouts:
        log.warning(
            "update %d: %d environment steps missed rollout.episode.step_timeout_s=%ss (each became a "
            "timeout observation; step_timeouts in metrics.jsonl)",
            update, timeouts, r.episode.step_timeout_s,
        )  # fmt: skip
    interrupted = share_count(ranks, result.interrupted) if r.max_staleness >= 1 else 0
    stats = result.stats
    lost_servers = max(int(n) for n in ranks.gather(str(stats.servers_lost))) if ranks.world_size > 1 else 0
    return Produced(
        tuple((t,) for t in trees), seconds, len(lost), timeouts, interrupted=interrupted,
        servers_lost=max(stats.servers_lost, lost_servers),
        servers=share_servers(ranks, tuple(s.row() for s in stats.servers)),
        weight_sync_bytes=share_count(ranks, stats.sync_bytes), weight_sync_seconds=stats.sync_seconds,
    )  # fmt: skip
