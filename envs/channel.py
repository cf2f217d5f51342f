"""Many callers, one pipe: requests to an environment worker carry an id, and one reader thread hands each
reply to the caller waiting for that id.

The trainer's threads (one per episode step in flight) share one worker process. Each call takes one of
the worker's `slots` (the worker runs that many requests at once, so a sent request starts at once and
its deadline measures the worker, not a queue), registers a waiter under a fresh id, sends, and waits on
its own deadline. The reader thread is the only one that receives: it decodes each reply (bounded by
`MAX_REPLY_BYTES`, JSON only, never unpickled) and wakes its waiter.

A caller whose deadline passes fails alone: its request is abandoned (a late reply to it is dropped, and
only then is its slot free again), and the worker goes on serving every other call, so one hung step or
slow rubric ends only its own task. Before saying so the channel pings the worker (`ping`, answered by the
worker's main loop, outside its pool): a worker that does not answer the ping within `probe_s` is stuck
(code in C holding its interpreter, a stopped process) and would stall every later call too, so it is
stopped, as below.

Anything that breaks the protocol breaks the channel for every caller at once, because no later reply can
be trusted: the worker dying, a reply that is oversized, not JSON, not an object with `id` and `ok` or
`error`, or for an id no one waits for (or abandoned). The worker is stopped and each waiting caller gets
the reason, naming its own method; later calls fail at once (`WorkerGone`), and the factory starts a fresh
worker. A caller that is interrupted (Ctrl-C) stops the worker the same way, so nothing runs on unseen.

Example (the echoing "worker" here is a thread; `envs.remote.EnvWorker` runs `envs.worker.serve`):
    >>> import json, multiprocessing, threading
    >>> mine, theirs = multiprocessing.Pipe()
    >>> def echo():
    ...     req = json.loads(theirs.recv_bytes())
    ...     theirs.send_bytes(json.dumps({"id": req["id"], "ok": req["x"] * 2}).encode())
    >>> threading.Thread(target=echo).start()
    >>> channel = Channel(mine, lambda: None, slots=2)
    >>> channel.call("double", {"x": 21}, None)
    ('ok', 42)
    >>> channel.close("WorkerGone: closed"); theirs.close()
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from envs.wire import MAX_REPLY_BYTES, WireError, dumps, loads


@dataclass
class _Waiter:
    """One caller waiting for the reply to its request."""

    method: str
    done: threading.Event = field(default_factory=threading.Event)
    reply: tuple[str, Any] | None = None
    """("ok", value) or ("error", the error object), once answered."""
    broken: str | None = None
    """Why it will never be answered, once the channel broke."""


class Channel:
    """Concurrent calls over one duplex `Connection` to a worker. `on_break` stops the worker (called once,
    when the channel breaks); `exit_text` says, after the worker's end closed, how it ended; `probe_s` is how
    long the worker has to answer a ping after a call's deadline passed."""

    def __init__(
        self,
        conn: Connection,
        on_break: Callable[[], None],
        slots: int,
        exit_text: Callable[[], str] = lambda: "WorkerGone: the worker closed the pipe",
        probe_s: float = 10.0,
    ) -> None:
        self._conn, self._on_break, self._exit_text = conn, on_break, exit_text
        self.probe_s = probe_s
        self._slots = threading.BoundedSemaphore(slots)
        self._lock = threading.Lock()  # guards _waiters, _abandoned, _broken and sending
        self._waiters: dict[int, _Waiter] = {}
        self._abandoned: set[int] = set()
        """Requests whose caller's deadline passed: their slot is freed when their late reply comes."""
        self._ids = itertools.count(1)
        self._broken: str | None = None
        self._reader = threading.Thread(target=self._read, name="treetrain-env-replies", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._broken is None

    @property
    def waiting(self) -> int:
        """How many calls are waiting for their reply."""
        with self._lock:
            return len(self._waiters)

    @property
    def overdue(self) -> int:
        """How many abandoned requests (their caller's deadline passed) the worker has not answered yet."""
        with self._lock:
            return len(self._abandoned)

    def call(self, method: str, request: dict[str, Any], deadline: float | None) -> tuple[str, Any]:
        """Send `request` and wait up to `deadline` seconds (None: forever) for its reply: ("ok", value),
        ("error", the worker's error object), ("timeout", why: only this call failed), or ("broken", why it
        cannot be answered: `Kind: detail`)."""
        try:
            if not self._slots.acquire(timeout=deadline):
                return "timeout", (
                    f"Timeout: no free slot within {deadline:g}s (every one is held by a call past its deadline)"
                )
            release_slot = True
            try:
                waiter, ident = _Waiter(method), next(self._ids)
                with self._lock:
                    if self._broken is not None:
                        return "broken", f"WorkerGone: the worker had already stopped ({self._broken})"
                    self._waiters[ident] = waiter
                    with contextlib.suppress(OSError):  # the worker is gone; the reader reports how
                        self._conn.send_bytes(dumps({**request, "id": ident}))
                if not waiter.done.wait(deadline) and self._abandon(ident):
                    assert deadline is not None
                    release_slot = False  # the reader frees it when the late reply comes
                    if self._answers_ping(method):
                        return "timeout", (
                            f"Timeout: no answer within {deadline:g}s (the worker still answers; only this "
                            "call failed)"
                        )
                    self._break(
                        f"WorkerStopped: another call ({method}) had no answer within {deadline:g}s and the "
                        f"worker answered no ping within {self.probe_s:g}s, so it was stopped"
                    )
                    return "broken", (
                        f"Timeout: no answer within {deadline:g}s, nor to a ping; the worker was stopped"
                    )
            finally:
                if release_slot:
                    self._slots.release()
        except BaseException as exc:  # Ctrl-C while waiting: stop the worker, so nothing runs on unseen
            self._break(
                f"WorkerStopped: interrupted ({type(exc).__name__}) while waiting; the worker was stopped"
            )
            raise
        if waiter.reply is None:
            return "broken", waiter.broken or "WorkerGone: the worker stopped answering"
        return waiter.reply

    def _abandon(self, ident: int) -> bool:
        """Give up on request `ident` (its deadline passed); False when its reply came in meanwhile."""
        with self._lock:
            waiter = self._waiters.pop(ident, None)
            if waiter is None or waiter.done.is_set():
                return False
            self._abandoned.add(ident)
            return True

    def _answers_ping(self, method: str) -> bool:
        """Whether the worker's main loop still answers (within `probe_s`); no slot needed."""
        waiter, ident = _Waiter(f"ping after {method}"), next(self._ids)
        with self._lock:
            if self._broken is not None:
                return False
            self._waiters[ident] = waiter
            with contextlib.suppress(OSError):
                self._conn.send_bytes(dumps({"op": "ping", "id": ident}))
        answered = waiter.done.wait(self.probe_s) and waiter.reply is not None
        with self._lock:
            self._waiters.pop(ident, None)
        return answered

    def close(self, text: str) -> None:
        """Ask the worker to exit and break the channel on purpose: every waiting call fails with `text`
        (the caller then makes sure the worker has exited; `on_break` is not called)."""
        with self._lock:
            if self._broken is None:
                with contextlib.suppress(OSError):
                    self._conn.send_bytes(dumps({"op": "stop"}))
        self._break(text, stop=False)

    def _break(self, text: str, own: tuple[_Waiter, str] | None = None, stop: bool = True) -> None:
        with self._lock:
            if own is not None and own[0].done.is_set():
                return  # its reply came in just as its deadline passed
            first = self._broken is None
            if first:
                self._broken = text
            waiters, self._waiters = list(self._waiters.values()), {}
            for waiter in waiters:
                waiter.broken = own[1] if own is not None and waiter is own[0] else text
                waiter.done.set()
        if first and stop:
            self._on_break()

    def _read(self) -> None:
        while self.alive:
            try:
                data = self._conn.recv_bytes(MAX_REPLY_BYTES)
            except (EOFError, OSError) as exc:  # the worker died, or sent more than MAX_REPLY_BYTES
                if self.alive:
                    ended = isinstance(exc, EOFError | BrokenPipeError | ConnectionResetError)
                    self._break(
                        self._exit_text()
                        if ended
                        else f"WireError: a reply over {MAX_REPLY_BYTES} bytes, or unreadable ({exc})"
                    )
                break
            try:
                ident, reply = _decoded(data)
            except WireError as exc:
                self._break(f"WireError: {exc}")
                break
            with self._lock:
                waiter = self._waiters.pop(ident, None)
                if waiter is not None:
                    waiter.reply = reply
                    waiter.done.set()
                late = waiter is None and ident in self._abandoned
                if late:
                    self._abandoned.discard(ident)
            if late:  # the answer to a call that gave up: dropped, and its slot is free again
                self._slots.release()
                continue
            if waiter is None and self.alive:
                self._break(f"WireError: a reply to request {ident}, which no call is waiting for")
                break
        with contextlib.suppress(OSError):
            self._conn.close()  # only this thread reads, so only it may close


def _decoded(data: bytes) -> tuple[int, tuple[str, Any]]:
    reply = loads(data)
    if not isinstance(reply, dict):
        raise WireError("a reply that is not an object")
    ident = reply.get("id")
    if isinstance(ident, bool) or not isinstance(ident, int):
        raise WireError("a reply without a request id")
    if "error" in reply:
        return ident, ("error", reply["error"])
    if "ok" in reply:
        return ident, ("ok", reply["ok"])
    raise WireError("a reply without 'ok' or 'error'")
