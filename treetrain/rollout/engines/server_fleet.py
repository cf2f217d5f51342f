"""Which `vllm serve` process gets a request: prefix affinity while there is room, else the least loaded;
which servers are lost, and when a lost one is probed again.

A tree's requests share its context, so they go where the first went (its server's prefix cache holds
it) while that server has room: nothing waits in its queue, its KV cache is under `KV_FULL`, and the
samples in flight there (ours as counted here, or all of them as its metrics say) leave room for the new
ones within its `--max-num-seqs`. Otherwise the group moves to the least loaded server: the fewest
sequences running or waiting per slot, plus the fraction of its KV cache in use. Servers equally loaded
(idle ones, at the start) are taken in an order that starts at the client's own (`first`: the trainer
rank, when each rank is a client of the fleet), so clients that start at once spread over the fleet rather
than all choosing the first server. The load is read from
each server's Prometheus endpoint (`GET /metrics`: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, and the queue-time histogram `vllm:request_queue_time_seconds` for the
statistics), at most every `METRICS_EVERY_S`; between reads, and for a server whose metrics cannot be read,
the samples in flight stand in for it. The numbers only order servers: nothing is sized from them.

A server that does not answer is lost (`lost`): it gets no work until a probe (`to_probe`, every
`PROBE_EVERY_S`) finds it answering and the engine has reloaded it to the current weights (`back`).

`Fleet` holds no lock and does no I/O: the engine calls it under its own lock, with the metrics it read.

Example:
    >>> fleet = Fleet(("http://a", "http://b"), capacities=(8, 8), clock=lambda: 0.0)
    >>> fleet.pick("task-1", 2, in_flight=(0, 0)), fleet.pick("task-2", 2, in_flight=(2, 0))
    (0, 1)
    >>> fleet.pick("task-1", 2, in_flight=(2, 2))  # its server still has room
    0
    >>> fleet.lost(0, "cannot connect"), fleet.pick("task-1", 2, in_flight=(0, 2))
    (True, 1)
    >>> Fleet(("http://a", "http://b"), capacities=(8, 8), first=1).pick("task-1", 2, in_flight=(0, 0))
    1
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from treetrain.rollout.engines.generation import ServerStats

METRICS_EVERY_S = 0.5
"""Oldest a server's metrics may be when a request is routed."""
PROBE_EVERY_S = 5.0
"""How often a lost server is asked whether it answers again."""
KV_FULL = 0.9
"""KV-cache use above which a server has no room for a group's next request."""
MAX_METRICS_BYTES = 4 * 2**20
"""Largest `/metrics` text read (vLLM's is tens of kilobytes)."""
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
QUEUE_TIME = "vllm:request_queue_time_seconds"
MAX_VALUE = 1e12
"""Largest value kept from a server's metrics (a larger one, or a sum over labels past it, is cut to it)."""


@dataclass(frozen=True)
class ServerLoad:
    """What a server's metrics say: sequences running and waiting, the fraction of its KV cache in use, and
    its queue-time histogram's running sum and count (since the server started)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    queue_seconds: float = 0.0
    queued: float = 0.0


def read_load(text: str) -> ServerLoad:
    """The load in a Prometheus text exposition (summed over label sets: engines, models); a `ValueError`
    when it is not one. A value that is not a finite non-negative number is left out; a sum is cut at
    `MAX_VALUE`, and the KV use at 1.

    >>> read_load('vllm:num_requests_waiting{engine="0"} 3.0\\nvllm:kv_cache_usage_perc{engine="0"} 0.25\\n')
    ServerLoad(running=0.0, waiting=3.0, kv_usage=0.25, queue_seconds=0.0, queued=0.0)
    """
    from prometheus_client.parser import text_string_to_metric_families

    found = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "queue_seconds": 0.0, "queued": 0.0}
    names = {**GAUGES, QUEUE_TIME + "_sum": "queue_seconds", QUEUE_TIME + "_count": "queued"}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = names.get(sample.name)
                value = float(sample.value)
                if key is not None and math.isfinite(value) and value >= 0:
                    found[key] = min(found[key] + value, MAX_VALUE)
    except (KeyError, IndexError, TypeError) as exc:  # the parser's ways of failing besides ValueError
        raise ValueError(f"not Prometheus text ({type(exc).__name__}: {exc})") from None
    return ServerLoad(**{**found, "kv_usage": min(found["kv_usage"], 1.0)})


@dataclass
class _Server:
    url: str
    capacity: int
    """Its `--max-num-seqs`: sequences it runs at once."""
    load: ServerLoad | None = None
    read_at: float = -math.inf
    reading: bool = False
    lost: str | None = None
    """Why it is lost (None while it serves)."""
    probe_at: float = 0.0
    seen: ServerLoad | None = None
    """The histogram as last read, to count what was queued since."""
    stats: ServerStats = field(default_factory=lambda: ServerStats(""))


class Fleet:
    """The servers, their loads, which group sits where, and which are lost; see the module docstring."""

    def __init__(
        self,
        urls: Sequence[str],
        capacities: Sequence[int],
        clock: Callable[[], float] = time.monotonic,
        first: int = 0,
    ) -> None:
        self.servers = [
            _Server(u, max(1, c), stats=ServerStats(u)) for u, c in zip(urls, capacities, strict=True)
        ]
        self.clock = clock
        self.first = first % len(self.servers)
        """The server this client takes first among equally loaded ones (its trainer rank, modulo the fleet)."""
        self.affinity: dict[str, int] = {}
        self.servers_lost = 0
        """Servers lost so far (a server lost twice counts twice)."""

    @property
    def alive(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.servers) if s.lost is None)

    def pending(self, i: int, in_flight: int) -> float:
        """Sequences on server `i`: all of them as its metrics last said, or ours, whichever is more."""
        load = self.servers[i].load or ServerLoad()
        return max(load.running + load.waiting, float(in_flight))

    def has_room(self, i: int, n: int, in_flight: int) -> bool:
        s = self.servers[i]
        load = s.load or ServerLoad()
        return load.waiting == 0 and load.kv_usage < KV_FULL and self.pending(i, in_flight) + n <= s.capacity

    def pick(self, group: str, n: int, in_flight: Sequence[int]) -> int | None:
        """The server for a request of `group` with `n` samples (None when every server is lost)."""
        home = self.affinity.get(group)
        if home is not None and self.servers[home].lost is None and self.has_room(home, n, in_flight[home]):
            return home
        alive = self.alive
        if not alive:
            return None

        def key(i: int) -> tuple[float, int, int]:
            s = self.servers[i]
            load = s.load or ServerLoad()
            turn = (i - self.first) % len(self.servers)
            return ((self.pending(i, in_flight[i]) + n) / s.capacity + load.kv_usage, in_flight[i], turn)

        chosen = min(alive, key=key)
        self.affinity[group] = chosen
        return chosen

    def sent(self, i: int, n: int) -> None:
        """A request of `n` samples went to server `i`."""
        st = self.servers[i].stats
        self.servers[i].stats = replace(st, requests=st.requests + 1, samples=st.samples + n)

    def release(self, group: str) -> None:
        """The group's tree is finished: forget where it sat."""
        self.affinity.pop(group, None)

    def to_read(self, now: bool = False) -> list[int]:
        """Servers serving whose metrics are older than `METRICS_EVERY_S` (`now`: any age) and not being
        read; marked as being read until `observe`."""
        age = 0.0 if now else METRICS_EVERY_S
        clock = self.clock()
        due = [
            i for i in self.alive if not self.servers[i].reading and clock - self.servers[i].read_at >= age
        ]
        for i in due:
            self.servers[i].reading = True
        return due

    def observe(self, i: int, load: ServerLoad | None) -> None:
        """Server `i`'s metrics as just read (None: they could not be, so its samples in flight stand in)."""
        s = self.servers[i]
        s.reading, s.read_at, s.load = False, self.clock(), load
        if load is None:
            return
        seen = s.seen or ServerLoad()
        if load.queued < seen.queued:  # the server restarted: its histogram began again
            seen = ServerLoad()
        s.stats = replace(
            s.stats,
            queue_seconds=s.stats.queue_seconds + max(0.0, load.queue_seconds - seen.queue_seconds),
            queued=s.stats.queued + int(load.queued - seen.queued),
        )
        s.seen = load

    def lost(self, i: int, why: str) -> bool:
        """Server `i` did not answer: it gets no work until it is `back`. True when it was serving until now."""
        s = self.servers[i]
        if s.lost is not None:
            return False
        s.lost, s.load, s.probe_at, s.reading = why, None, self.clock() + PROBE_EVERY_S, False
        self.servers_lost += 1
        return True

    def to_probe(self) -> list[int]:
        """Lost servers due for a probe; the next one is `PROBE_EVERY_S` later."""
        now = self.clock()
        due = [i for i, s in enumerate(self.servers) if s.lost is not None and now >= s.probe_at]
        for i in due:
            self.servers[i].probe_at = now + PROBE_EVERY_S
        return due

    def back(self, i: int) -> None:
        """Server `i` answers again and holds the current weights: it takes work again."""
        s = self.servers[i]
        s.lost, s.read_at = None, -math.inf

    def stats(self) -> tuple[ServerStats, ...]:
        return tuple(s.stats for s in self.servers)
