"""Jobs on a bounded thread pool, one lane per key: jobs of one key run one after another, in the order they
were submitted; jobs of different keys run at once.

An environment worker runs each request in its own thread so that a slow tool on one environment does not
hold up the others, but an environment object is not assumed thread-safe: the requests on one handle
(step, fork, score, release) form a lane. A lane holds at most one pool thread, and only while it has work,
so a lane waiting for its turn never occupies a thread (a per-handle lock would park a thread on it, and a
pool full of parked threads would starve the lane they wait for).

Example:
    >>> import threading
    >>> order, gate = [], threading.Event()
    >>> lanes = Lanes(workers=2)
    >>> lanes.submit("a", lambda: (gate.wait(5), order.append("a1")))
    >>> lanes.submit("a", lambda: order.append("a2"))          # waits for a1: same lane
    >>> lanes.submit("b", lambda: (order.append("b"), gate.set()))  # runs at once: its own lane
    >>> lanes.shutdown()
    >>> order
    ['b', 'a1', 'a2']
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor


class Lanes:
    """See the module docstring. `workers` bounds the threads; a job must not raise (it is the job's to
    report its own failure)."""

    def __init__(self, workers: int, name: str = "lane") -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._queued: dict[Hashable, deque[Callable[[], object]]] = {}
        """Each busy lane's jobs not yet started (a key is here exactly while its lane holds a thread)."""

    def submit(self, key: Hashable, job: Callable[[], object]) -> None:
        with self._lock:
            queued = self._queued.get(key)
            if queued is not None:
                queued.append(job)
                return
            self._queued[key] = deque()
        self._pool.submit(self._drain, key, job)

    def _drain(self, key: Hashable, job: Callable[[], object]) -> None:
        while True:
            with contextlib.suppress(
                Exception
            ):  # a job reports its own errors; a slip must not stop the lane
                job()
            with self._lock:
                queued = self._queued[key]
                if not queued:
                    del self._queued[key]
                    return
                job = queued.popleft()

    def shutdown(self) -> None:
        """Wait for every submitted job to finish."""
        self._pool.shutdown(wait=True)
