"""The environment worker: a process that hosts environments and runs their code for the trainer.

The trainer starts one with the environment's name, constructor arguments and how many requests it may
run at once (`envs.remote.EnvWorker`); the worker builds every environment itself, from the name, so
nothing is pickled from the trainer. It then answers JSON requests on a pipe: build an environment, reset,
step (under the step deadline, on a copy, as `envs.step_thread.step_within` does in-process), fork, score
with a rubric, release, and `ping` (answered at once by the main loop: the trainer's check that a worker
whose call is overdue is still alive, `envs.channel`). Each environment is a numbered handle; a fork is a new handle in the same worker.

Requests run concurrently, each in a thread of a bounded pool, and each reply goes back with its request's
id as soon as it is ready: a tool that sleeps on one handle holds up no other. An environment object is not
assumed thread-safe, so the requests of one handle run one after another in the order they came (a lane,
`envs.lanes`), and so do the builds of new environments (constructors may share module state).

Whatever the environment does stays here: an exception (even `SystemExit`) becomes an error reply naming
the method, the exception and where it was raised, with the full traceback; `os._exit`, a crash, a closed
stdout or a print that never ends take down or block only this process, which the trainer sees as a dead
or silent worker. Ctrl-C is the trainer's to handle, so the worker ignores SIGINT; it exits when the
trainer closes the pipe (or dies).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from envs.env_error import raised_at, summary
from envs.lanes import Lanes
from envs.protocol import Environment, Episode, Message, StepResult
from envs.registry import resolve
from envs.step_thread import step_within
from envs.tools import StepAbandoned
from envs.wire import (
    MAX_NAME_CHARS,
    MAX_REPLY_BYTES,
    MAX_TRACEBACK_CHARS,
    dumps,
    messages_from_wire,
    messages_to_wire,
    result_to_wire,
    tools_to_wire,
)


class _Refused(Exception):
    """A value the environment returned that the protocol does not allow (the message says which)."""


def error_reply(method: str, exc: BaseException) -> dict[str, Any]:
    """The reply for an exception raised by environment code during `method`."""
    if isinstance(exc, _Refused):
        text, tb, where = str(exc)[:MAX_NAME_CHARS], f"{method}: {exc}\n", ""
    else:
        text, where = summary(exc), raised_at(exc)
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "error": {
            "method": method,
            "exception": text,
            "where": where,
            "traceback": tb[-MAX_TRACEBACK_CHARS:],
        }
    }


class _Host:
    """The environments of one worker, by handle."""

    def __init__(self, name: str, kwargs: Mapping[str, Any]) -> None:
        self.name, self.kwargs = name, dict(kwargs)
        self._envs: dict[int, Environment] = {}
        self._next = 0
        self._lock = threading.Lock()  # requests of different handles run in different threads
        self._cls: type[Environment] | None = None

    def _add(self, env: Environment) -> int:
        with self._lock:
            self._next += 1
            self._envs[self._next] = env
            return self._next

    def _env(self, req: Mapping[str, Any]) -> Environment:
        handle = int(req["handle"])
        with self._lock:
            env = self._envs.get(handle)
        if env is None:
            raise KeyError(f"no environment with handle {handle} (released?)")
        return env

    def new(self, req: Mapping[str, Any]) -> Any:
        if self._cls is None:  # resolved once: a registry scan reads every installed package's metadata
            self._cls = _guard("__init__", lambda: resolve(self.name))
        cls = self._cls
        env = _guard("__init__", lambda: cls(**self.kwargs))
        names = _guard("rubrics", lambda: [str(n) for n in env.rubrics()])
        return {"handle": self._add(env), "rubrics": names, "class": type(env).__name__}

    def reset(self, req: Mapping[str, Any]) -> Any:
        env = self._env(req)
        opening = _guard("reset", lambda: env.reset(int(req["seed"])))
        if not isinstance(opening, Sequence) or isinstance(opening, str) or not opening:
            raise _Failed(
                "reset", _Refused(f"returned {_short(opening)}, not a non-empty sequence of Message")
            )
        if any(not isinstance(m, Message) or m.role not in ("system", "user") for m in opening):
            raise _Failed("reset", _Refused(f"must return system/user messages, got {_short(opening)}"))
        tools = _guard("tool_specs", lambda: tools_to_wire(tuple(env.tool_specs())))
        return {"messages": messages_to_wire(opening), "tools": tools}

    def step(self, req: Mapping[str, Any]) -> Any:
        env = self._env(req)
        (message,) = messages_from_wire([req["message"]])
        timeout = req.get("timeout")
        if timeout is None:
            return {"result": result_to_wire(_checked_step(env, message))}
        try:
            stepped = step_within(env, message, float(timeout), _checked_step, self.name)
        except _Failed:
            raise
        except Exception as exc:
            raise _Failed("copy.deepcopy (rollout.episode.step_timeout_s steps a copy)", exc) from None
        if stepped is None:
            return {"timeout": True}
        with self._lock:  # its own lane: nothing else touched this handle meanwhile
            self._envs[int(req["handle"])] = stepped[0]
        return {"result": result_to_wire(stepped[1])}

    def fork(self, req: Mapping[str, Any]) -> Any:
        env = self._env(req)
        twin = _guard("fork", lambda: env.fork(int(req["branch"])))
        if not isinstance(twin, Environment):
            raise _Failed("fork", _Refused(f"returned {_short(twin)}, not an Environment"))
        return {"handle": self._add(twin)}

    def score(self, req: Mapping[str, Any]) -> Any:
        env = self._env(req)
        rubrics = _guard("rubrics", env.rubrics)
        name = str(req["rubric"])
        rubric = rubrics[name]
        state = _guard("state", env.state)
        episode = Episode(messages_from_wire(req["messages"]), state, str(req["finish"]))
        method = f"rubric {name!r} ({type(rubric).__name__}.score)"
        return {"reward": _guard(method, lambda: float(rubric(episode)))}

    def release(self, req: Mapping[str, Any]) -> Any:
        with self._lock:
            self._envs.pop(int(req["handle"]), None)
        return {}


class _Failed(Exception):
    def __init__(self, method: str, exc: BaseException) -> None:
        super().__init__(method)
        self.method, self.exc = method, exc


def _short(value: object) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"a {type(value).__name__}"
    return text if len(text) <= 120 else f"{text[:117]}..."


def _guard(method: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except StepAbandoned:  # the step's deadline passed: its thread is to stop, not to report
        raise
    except BaseException as exc:  # `sys.exit` in a request's thread fails that request, not the worker
        raise _Failed(method, exc) from None


def _checked_step(env: Environment, message: Message) -> StepResult:
    result = _guard("step", lambda: env.step(message))
    if not isinstance(result, StepResult):
        raise _Failed("step", _Refused(f"returned {_short(result)}, not a StepResult"))
    return result


def serve(conn: Connection, name: str, kwargs_json: str, max_concurrent: int = 1) -> None:
    """The worker's main loop (the target of the worker process): read requests, run each in its lane
    (`envs.lanes`: one per handle, one for building environments) on `max_concurrent` threads, and send
    each reply, with its request's id, as soon as it is ready."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    host = _Host(name, json.loads(kwargs_json))
    ops: dict[str, Callable[[Mapping[str, Any]], Any]] = {
        "new": host.new, "reset": host.reset, "step": host.step, "fork": host.fork, "score": host.score,
        "release": host.release,
    }  # fmt: skip
    sending = threading.Lock()

    def answer(req: dict[str, Any]) -> None:
        data = _reply(ops, req)
        try:
            with sending:
                conn.send_bytes(data)
        except OSError:  # the trainer is gone
            _exit()

    def answer_now(ident: object) -> None:
        try:
            with sending:
                conn.send_bytes(dumps({"id": ident, "ok": {}}))
        except OSError:
            _exit()

    lanes = Lanes(max_concurrent, name="treetrain-env")
    while True:
        try:
            req = json.loads(conn.recv_bytes().decode("utf-8"))
        except (EOFError, OSError, ValueError):  # the trainer closed the pipe (or broke the protocol)
            break
        if not isinstance(req, dict) or req.get("op") == "stop":
            break
        if req.get("op") == "ping":  # answered here, outside the pool: says the process is not stuck
            answer_now(req.get("id"))
            continue
        handle = req.get("handle")
        lane = handle if isinstance(handle, int) and not isinstance(handle, bool) else req.get("op")
        lanes.submit(lane, functools.partial(answer, req))
    _exit()


def _reply(ops: Mapping[str, Callable[[Mapping[str, Any]], Any]], req: Mapping[str, Any]) -> bytes:
    """The reply to `req`, encoded and bounded; whatever went wrong is an error reply."""
    op, ident = req.get("op"), req.get("id")
    try:
        reply: Any = {"ok": ops[str(op)](req)}
    except _Failed as failed:
        reply = error_reply(failed.method, failed.exc)
    except BaseException as exc:  # a protocol slip between the two ends: report it, keep serving
        reply = error_reply(f"worker {op}", exc)
    try:
        data = dumps({"id": ident, **reply})
    except (TypeError, ValueError) as exc:  # e.g. a lone surrogate in a tool result
        data = dumps({"id": ident, **error_reply(str(op), exc)})
    if len(data) > MAX_REPLY_BYTES:
        refused = _Refused(f"a reply of {len(data)} bytes, over {MAX_REPLY_BYTES}")
        data = dumps({"id": ident, **error_reply(str(op), refused)})
    return data


def _exit() -> None:
    with contextlib.suppress(Exception):  # what the environment printed, unless it closed stdout
        sys.stdout.flush()
    os._exit(0)  # threads of running and abandoned steps must not keep the process alive
