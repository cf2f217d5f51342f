"""The child side of `treetrain.rollout.engines.hf_process`: the messages both sides exchange, and the loop
the sampler process runs.

The child is spawned before there is a policy (`treetrain.rollout.engines.sampler_process`): its first
command, `Start`, brings the shadow (shared memory) and the engine's settings. It builds a private copy of
the shadow and an `HFEngine` over it, and answers `Ready`. While
the engine has requests it decodes step after step, reading the parent's commands between steps and sending
each finished `GenerationResult` back at once; when idle it waits for the next command. Replies go out on a
thread of their own, so a parent busy submitting never finds the child blocked on a full pipe instead of
reading. `Sync` copies the shadow into the private model and answers when done: the parent holds the
feed's lock until then, so a publish never rewrites what is being read.

Example (the messages are plain frozen dataclasses, pickled through the pipes):
    >>> Sync(3), Abort()
    (Sync(version=3), Abort())
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from treetrain.rollout.engines.generation import EngineStats, GenerationRequest, GenerationResult, Interrupted
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.rollout.engines.server_calls import short
from treetrain.rollout.weight_feed import copy_weights, private_copy, settle


# ----- the protocol: parent -> child ---------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """The first command: the shared shadow to copy and sample from, and how."""

    shadow: Any
    settings: ChildSettings


@dataclass(frozen=True)
class Submit:
    rid: int
    request: GenerationRequest


@dataclass(frozen=True)
class Sync:
    """Copy the shared shadow into the private model and sample as `version` from now on."""

    version: int


@dataclass(frozen=True)
class ReleaseGroup:
    group: str


@dataclass(frozen=True)
class Abort:
    pass


@dataclass(frozen=True)
class Interrupt:
    pass


@dataclass(frozen=True)
class Close:
    pass


Command = Start | Submit | Sync | ReleaseGroup | Abort | Interrupt | Close


# ----- the protocol: child -> parent ---------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    at: float
    """`time.time()` when the child's model and engine were built."""
    threads: int
    """The child's torch threads."""


@dataclass(frozen=True)
class Finished:
    results: tuple[GenerationResult, ...]
    """Under the parent's request ids."""
    stats: EngineStats


@dataclass(frozen=True)
class Synced:
    version: int
    stats: EngineStats


@dataclass(frozen=True)
class Stopped:
    """The answer to `Interrupt`: the child engine's `interrupt()` under the parent's ids."""

    stopped: tuple[Interrupted, ...]
    stats: EngineStats


@dataclass(frozen=True)
class Failed:
    line: str


Reply = Ready | Finished | Synced | Stopped | Failed


@dataclass(frozen=True)
class ChildSettings:
    threads: int
    max_kv_bytes: int | None
    version: int
    """The version of the shadow's weights at start (what the private copy samples as until a sync)."""


def one_line(exc: BaseException) -> str:
    """`exc` as `Name: message` on one line (the message cut to 300 characters)."""
    text = short(exc, 300)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ----- the loop -------------------------------------------------------------------------------------
def child_main(commands: Any, replies: Any) -> None:
    """The child process, its modules imported: wait for `Start`, build the private model and engine, then
    serve commands until `Close` (or the end of the command pipe: nobody adopted it, or the parent is gone)."""
    out = _Sender(replies)
    try:
        start = commands.recv()
        if isinstance(start, Start):
            torch.set_num_threads(start.settings.threads)
            _serve(start.shadow, start.settings, commands, out)
        elif not isinstance(start, Close):
            raise TypeError(f"the first command must be Start, not {type(start).__name__}")
    except EOFError:  # the parent is gone, or closed the process before giving it a policy
        pass
    except BaseException as exc:
        out.put(Failed(f"the sampler process failed: {one_line(exc)}"))
    out.close()


def _serve(shadow: Any, settings: ChildSettings, commands: Any, out: _Sender) -> None:
    model = private_copy(shadow)  # the engine samples from this copy only, never the shared shadow
    version = settings.version
    engine = HFEngine(model, version=version) if settings.max_kv_bytes is None else HFEngine(
        model, version=version, max_kv_bytes=settings.max_kv_bytes
    )  # fmt: skip
    ids: dict[int, int] = {}  # the engine's request id -> the parent's
    out.put(Ready(time.time(), torch.get_num_threads()))
    while True:
        if not engine.busy:
            if not _handle(commands.recv(), engine, model, shadow, ids, out):
                return
            continue
        while commands.poll():
            if not _handle(commands.recv(), engine, model, shadow, ids, out):
                return
        if engine.busy:
            done = engine.poll()
            if done:
                mine = tuple(replace(r, request_id=ids.pop(r.request_id)) for r in done)
                out.put(Finished(mine, copy.copy(engine.stats)))


def _handle(
    command: Command, engine: Any, model: Any, shadow: Any, ids: dict[int, int], out: _Sender
) -> bool:
    """Carry out one command; False on `Close`."""
    if isinstance(command, Submit):
        ids[engine.submit(command.request)] = command.rid
    elif isinstance(command, Sync):
        start = time.perf_counter()
        copied = copy_weights(model, shadow)
        settle(model)  # the parent may rewrite the shadow as soon as it has the answer
        engine.sync_weights(model, command.version)
        engine.stats.sync_seconds += time.perf_counter() - start
        engine.stats.sync_bytes += copied
        out.put(Synced(command.version, copy.copy(engine.stats)))
    elif isinstance(command, ReleaseGroup):
        engine.release_group(command.group)
    elif isinstance(command, Abort):
        engine.abort()
        ids.clear()
    elif isinstance(command, Interrupt):
        stopped = tuple(replace(s, request_id=ids.pop(s.request_id)) for s in engine.interrupt())
        ids.clear()
        out.put(Stopped(stopped, copy.copy(engine.stats)))
    elif isinstance(command, Close):
        return False
    else:
        raise TypeError(f"unknown command {type(command).__name__}")
    return True


class _Sender:
    """Replies go out on a thread of their own, so that a parent busy submitting never finds the child
    blocked on a full reply pipe instead of reading its commands."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[Reply | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="treetrain-hf-replies", daemon=True)
        self._thread.start()

    def put(self, reply: Reply) -> None:
        self._queue.put(reply)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        while (reply := self._queue.get()) is not None:
            try:
                self._conn.send(reply)
            except OSError:  # the parent is gone: nothing is left to answer
                os._exit(0)
