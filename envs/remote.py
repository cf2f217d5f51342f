"""Environments in worker processes, seen from the trainer: `EnvWorker`, `RemoteEnv` and `EnvFailure`.

`WorkerEnvFactory(name, kwargs)` is a drop-in for `lambda: make_env(name, **kwargs)`: each call returns a
`RemoteEnv`, a proxy `Environment` whose environment lives in a worker process (`envs.worker`). The token
wrapper and tree rollouts use it as any environment; forks are new handles in the same worker, rubrics
score there (where the environment's state is), and the step deadline is kept there too, so the trainer
never copies or threads the environment.

Calls are concurrent: the factory, its workers and their environments may be used from many threads at
once. Each request carries an id (`envs.channel`), the worker runs each in its own thread, in order per
handle (`envs.lanes`), and answers as soon as it is done, so a slow tool delays only its own episode. A
`RemoteEnv` sends one request at a time, and a worker builds one environment at a time, so a request's
deadline starts when the worker can start it: the step deadline plus `GRACE_S` for a step (the worker
keeps the step deadline itself and answers a timeout), `rubric_timeout` for a rubric (code execution and
judges take far longer than a tool call). With `workers=N` the factory gives root environments to N
processes in turn (a fork stays in its root's worker), for tools that are CPU-bound in Python, which one
process's interpreter lock would run one at a time.

Anything the environment does wrong surfaces as one exception, `EnvFailure`, carrying an `EnvError`: the
environment, the method, the exception, where it was raised and the full traceback. A call left
unanswered past its deadline fails alone (`Timeout: ...`): the worker goes on serving its other
environments, so one hung step or slow rubric ends one task. A worker that dies (`os._exit`, a crash, a
kill), that answers with something the protocol does not allow, or that answers not even a ping after a
missed deadline (stuck) is stopped, and every call waiting on it fails the same way, each naming its own
method; the next environment starts a fresh worker.

Example:
    >>> factory = WorkerEnvFactory("calculator", {"max_operands": 2})
    >>> env = factory()
    >>> env.reset(0)[0].role, [t.name for t in env.tool_specs()]
    ('system', ['calculate'])
    >>> factory.close()
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import multiprocessing
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from envs.channel import Channel
from envs.env_error import EnvError, EnvFailure
from envs.protocol import Episode, Message, Rubric, StepResult, ToolSpec
from envs.step_thread import DeadlineEnvironment
from envs.wire import (
    MAX_NAME_CHARS,
    MAX_TRACEBACK_CHARS,
    WireError,
    message_to_wire,
    messages_from_wire,
    messages_to_wire,
    names_from_wire,
    result_from_wire,
    tools_from_wire,
)
from envs.worker import serve
from treetrain.errors import ConfigError

RUBRIC_TIMEOUT_S = 300.0
"""How long a rubric may score one episode by default (the trainer passes `rollout.rubric_timeout_s`)."""
GRACE_S = 10.0
"""How much longer than the step deadline a worker may stay silent before the call fails (a step stuck in
C code, holding the interpreter, cannot be abandoned in its thread), and how long it then has to answer a
ping before it is taken to be stuck and stopped."""
BUILD_S = 300.0
"""How long building an environment may take, the worker's start (its imports) included."""
MAX_CONCURRENT = 16
"""Requests one worker runs at once by default (each in its own thread); the trainer passes its own bound."""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "WorkerGone: the worker process stopped answering"
    if code < 0:
        return f"WorkerDied: the worker process was killed by signal {-code}"
    return f"WorkerExited: the worker process exited with status {code} (os._exit or sys.exit in environment code?)"


def _error_from_wire(env: str, obj: object) -> EnvError:
    if not isinstance(obj, dict):
        return EnvError(env, "worker", "WireError: an error reply that is not an object")
    text = {k: str(obj.get(k, ""))[:MAX_NAME_CHARS] for k in ("method", "exception", "where")}
    trace = str(obj.get("traceback", ""))[-MAX_TRACEBACK_CHARS:]
    return EnvError(env, text["method"], text["exception"], text["where"], trace)


class EnvWorker:
    """One worker process hosting environments built from (`name`, `kwargs`), answering up to
    `max_concurrent` requests at once; safe to call from many threads. See the module docstring."""

    def __init__(
        self,
        name: str,
        kwargs: Mapping[str, Any],
        timeout: float | None,
        max_concurrent: int = MAX_CONCURRENT,
        rubric_timeout: float | None = RUBRIC_TIMEOUT_S,
    ) -> None:
        self.name, self.timeout, self.rubric_timeout = name, timeout, rubric_timeout
        self._kwargs = json.dumps(dict(kwargs))
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe(duplex=True)
        self._proc: BaseProcess = ctx.Process(
            target=serve,
            args=(child, name, self._kwargs, max_concurrent),
            name=f"treetrain-env-{name}",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._channel = Channel(
            conn, functools.partial(_kill, self._proc), max_concurrent, functools.partial(_ended, self._proc),
            probe_s=GRACE_S,
        )  # fmt: skip
        self._building = threading.Lock()
        """Held while an environment is built: builds run one at a time in the worker (constructors are not
        assumed thread-safe), so each one's deadline starts when it does."""
        self._finalizer = weakref.finalize(self, _stop, self._channel, self._proc)

    @property
    def alive(self) -> bool:
        return self._channel.alive

    @property
    def waiting(self) -> int:
        """How many calls are waiting for their reply now."""
        return self._channel.waiting

    @property
    def overdue(self) -> int:
        """How many calls gave up on their reply (deadline passed) while the worker still runs them."""
        return self._channel.overdue

    def call(self, method: str, request: dict[str, Any], extra_s: float = 0.0, scoring: bool = False) -> Any:
        """Send `request`, return the worker's answer; any failure is an `EnvFailure` naming `method`. The
        worker has the step deadline plus `GRACE_S` and `extra_s` to answer (no step deadline: forever), or
        when `scoring` (a rubric) the rubric deadline, counted from when the request is sent. Calls from other threads
        run meanwhile; a missed deadline fails this call only (see the module docstring)."""
        if scoring:
            deadline = self.rubric_timeout
        else:
            deadline = None if self.timeout is None else self.timeout + GRACE_S + extra_s
        kind, value = self._channel.call(method, request, deadline)
        if kind in ("broken", "timeout"):
            raise EnvFailure(EnvError(self.name, method, value))
        if kind == "error":
            raise EnvFailure(_error_from_wire(self.name, value))
        return value

    def build(self) -> Any:
        """Build one more environment in the worker (`new`); the reply names its handle."""
        with self._building:
            return self.call("__init__", {"op": "new"}, extra_s=BUILD_S)

    def kill(self) -> None:
        """Stop the worker at once (it is unusable afterwards; waiting calls fail)."""
        self._channel.close("WorkerStopped: the worker was stopped")
        _kill(self._proc)

    def close(self) -> None:
        """Ask the worker to exit, then make sure it has (waiting calls fail)."""
        self._finalizer()


def _kill(proc: BaseProcess) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(5.0)


def _ended(proc: BaseProcess) -> str:
    """How the worker ended, once its end of the pipe closed (it may take a moment to be reaped)."""
    proc.join(5.0)
    code = proc.exitcode
    if code is None:
        _kill(proc)
    return _exit_text(code)


def _stop(channel: Channel, proc: BaseProcess) -> None:
    channel.close("WorkerGone: the worker was closed")
    proc.join(2.0)
    _kill(proc)


@dataclass(frozen=True)
class RemoteState:
    """`RemoteEnv.state()`: the state stays in the worker; a rubric reaches it through this handle."""

    env: RemoteEnv


class RemoteRubric(Rubric):
    """A rubric of the remote environment, scored in the worker against the episode's own environment."""

    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, episode: Episode) -> float:
        state = episode.state
        if not isinstance(state, RemoteState):
            raise TypeError(f"rubric {self.name!r} of a worker environment scores only its own episodes")
        return state.env.score(self.name, episode)

    def __call__(self, episode: Episode) -> float:
        reward = self.score(episode)
        if not isinstance(reward, float) or reward != reward or reward in (float("inf"), float("-inf")):
            raise EnvFailure(EnvError(self.name, "rubric", f"ValueError: a reward of {reward!r}, not finite"))
        return reward


class RemoteEnv(DeadlineEnvironment):
    """An environment living in an `EnvWorker`, by handle; its calls may come from any thread (they are
    sent one at a time). See the module docstring."""

    def __init__(
        self, worker: EnvWorker, handle: int, rubric_names: Sequence[str], class_name: str = ""
    ) -> None:
        self.worker, self.handle = worker, handle
        self.class_name = class_name or worker.name
        """The environment's own class name (in the worker)."""
        self._rubrics = tuple(rubric_names)
        self._tools: tuple[ToolSpec, ...] = ()
        self._turn = threading.Lock()
        """One request of this handle in flight at a time, so each one's deadline starts when the worker
        can start it (the worker also runs a handle's requests in order, `envs.lanes`)."""

    def _call(self, method: str, op: str, scoring: bool = False, **fields: Any) -> Any:
        with self._turn:
            reply = self.worker.call(method, {"op": op, "handle": self.handle, **fields}, scoring=scoring)
        if not isinstance(reply, dict):
            raise EnvFailure(EnvError(self.worker.name, method, "WireError: a reply that is not an object"))
        return reply

    def _wire(self, method: str, fn: Any, value: object) -> Any:
        try:
            return fn(value)
        except WireError as exc:
            raise EnvFailure(EnvError(self.worker.name, method, f"WireError: {exc}")) from None

    def reset(self, seed: int) -> Sequence[Message]:
        reply = self._call("reset", "reset", seed=int(seed))
        self._tools = self._wire("tool_specs", tools_from_wire, reply.get("tools"))
        return self._wire("reset", messages_from_wire, reply.get("messages"))

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        return self._tools

    def step_within(self, message: Message, timeout: float | None) -> StepResult | None:
        reply = self._call("step", "step", message=message_to_wire(message), timeout=timeout)
        if reply.get("timeout") is True:
            return None
        return self._wire("step", result_from_wire, reply.get("result"))

    def state(self) -> RemoteState:
        return RemoteState(self)

    def rubrics(self) -> Mapping[str, Rubric]:
        return {name: RemoteRubric(name) for name in self._rubrics}

    def fork(self, branch: int = 0) -> RemoteEnv:
        handle = self._call("fork", "fork", branch=int(branch)).get("handle")
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise EnvFailure(EnvError(self.worker.name, "fork", "WireError: a fork without a handle"))
        twin = RemoteEnv(self.worker, handle, self._rubrics, self.class_name)
        twin._tools = self._tools
        return twin

    def score(self, rubric: str, episode: Episode) -> float:
        reply = self._call(
            f"rubric {rubric!r}", "score", True, rubric=rubric, messages=messages_to_wire(episode.messages),
            finish=episode.finish,
        )  # fmt: skip
        reward = reply.get("reward")
        return (
            float(reward)
            if isinstance(reward, int | float) and not isinstance(reward, bool)
            else float("nan")
        )

    def release(self) -> None:
        """Free this environment in the worker (best effort: a dead worker has nothing left to free)."""
        if self.worker.alive:
            with contextlib.suppress(EnvFailure):
                self._call("release", "release")


class WorkerEnvFactory:
    """`make_env(name, **kwargs)`, but each environment is built in a worker process; safe to call, and to
    use its environments, from many threads.

    `workers` processes serve the factory's environments (root environments are given to them in turn, a
    fork stays in its root's worker), each running up to `max_concurrent` requests at once: a step that
    sleeps or waits on I/O holds up only its own episode, and CPU-bound tools spread over the processes.
    A failed worker is replaced when its turn for a new environment comes. `timeout` (the step deadline)
    bounds how long any request may take, plus `GRACE_S`; `rubric_timeout` how long a rubric may."""

    def __init__(
        self,
        name: str,
        kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = 30.0,
        max_concurrent: int = MAX_CONCURRENT,
        workers: int = 1,
        rubric_timeout: float | None = RUBRIC_TIMEOUT_S,
    ) -> None:
        for field, value, most in (("max_concurrent", max_concurrent, 1024), ("workers", workers, 64)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise ConfigError(f"must be an integer in [1, {most}], got {value!r}", field=field)
        self.name, self.kwargs, self.timeout = name, dict(kwargs or {}), timeout
        self.max_concurrent, self.rubric_timeout = max_concurrent, rubric_timeout
        self._workers: list[EnvWorker | None] = [None] * workers
        self._turns = itertools.count()
        self._lock = threading.Lock()

    def _worker(self) -> EnvWorker:
        with self._lock:
            slot = next(self._turns) % len(self._workers)
            worker = self._workers[slot]
            if worker is None or not worker.alive:
                if worker is not None:
                    worker.close()
                worker = EnvWorker(
                    self.name, self.kwargs, self.timeout, self.max_concurrent, self.rubric_timeout
                )
                self._workers[slot] = worker
            return worker

    def __call__(self) -> RemoteEnv:
        worker = self._worker()
        reply = worker.build()
        if not isinstance(reply, dict) or not isinstance(reply.get("handle"), int):
            raise EnvFailure(EnvError(self.name, "__init__", "WireError: no handle in the reply"))
        try:
            names = names_from_wire(reply.get("rubrics"), "rubric names")
        except WireError as exc:
            raise EnvFailure(EnvError(self.name, "rubrics", f"WireError: {exc}")) from None
        class_name = reply.get("class")
        return RemoteEnv(worker, reply["handle"], names, str(class_name)[:MAX_NAME_CHARS])

    def close(self) -> None:
        """Stop the workers (a later call starts new ones); calls still waiting fail."""
        with self._lock:
            workers, self._workers = self._workers, [None] * len(self._workers)
        for worker in workers:
            if worker is not None:
                worker.close()
