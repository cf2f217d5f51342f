"""Environments in worker processes, seen from the trainer: `EnvWorker`, `RemoteEnv` and `EnvFailure`.

`WorkerEnvFactory(name, kwargs)` is a drop-in for `lambda: make_env(name, **kwargs)`: each call returns a
`RemoteEnv`, a proxy `Environment` whose environment lives in a worker process (`envs.worker`). The token
wrapper and tree rollouts use it as any environment; forks are new handles in the same worker, rubrics
score there (where the environment's state is), and the step deadline is kept there too, so the trainer
never copies or threads the environment.

Anything the environment does wrong surfaces as one exception, `EnvFailure`, carrying an `EnvError`: the
environment, the method, the exception, where it was raised and the full traceback. A worker that dies
(`os._exit`, a crash, a kill), that answers with something the protocol does not allow, or that stays
silent past the step deadline plus `GRACE_S` is stopped and reported the same way; the next environment
starts a fresh worker.

Example:
    >>> factory = WorkerEnvFactory("calculator", {"max_operands": 2})
    >>> env = factory()
    >>> env.reset(0)[0].role, [t.name for t in env.tool_specs()]
    ('system', ['calculate'])
    >>> factory.close()
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from envs.protocol import Episode, Message, Rubric, StepResult, ToolSpec
from envs.step_thread import DeadlineEnvironment
from envs.wire import (
    MAX_NAME_CHARS,
    MAX_REPLY_BYTES,
    MAX_TRACEBACK_CHARS,
    WireError,
    dumps,
    loads,
    message_to_wire,
    messages_from_wire,
    messages_to_wire,
    names_from_wire,
    result_from_wire,
    tools_from_wire,
)
from envs.worker import serve
from envs.wrapper import EnvStepError

GRACE_S = 10.0
"""How much longer than the step deadline a worker may stay silent before it is stopped (a step stuck in
C code, holding the interpreter, cannot be abandoned in its thread)."""
BUILD_S = 300.0
"""How long building an environment may take, the worker's start (its imports) included."""


@dataclass(frozen=True)
class EnvError:
    """One failure of environment code: which environment, which method, what was raised, and where."""

    env: str
    method: str
    exception: str
    where: str = ""
    traceback: str = ""

    def line(self) -> str:
        """One line naming all of it (the traceback aside).

        >>> EnvError("my_env:Maze", "step", "ValueError: wall", "maze.py:12").line()
        'my_env:Maze: step raised ValueError: wall (at maze.py:12)'
        """
        at = f" (at {self.where})" if self.where else ""
        return f"{self.env}: {self.method} raised {self.exception}{at}"


class EnvFailure(EnvStepError):
    """Environment code failed (in a worker); `error` says how."""

    def __init__(self, error: EnvError) -> None:
        super().__init__(error.line())
        self.error = error


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
    """One worker process hosting environments built from (`name`, `kwargs`); see the module docstring."""

    def __init__(self, name: str, kwargs: Mapping[str, Any], timeout: float | None) -> None:
        self.name, self.timeout = name, timeout
        self._kwargs = json.dumps(dict(kwargs))
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc: BaseProcess = ctx.Process(
            target=serve, args=(child, name, self._kwargs), name=f"treetrain-env-{name}", daemon=True
        )
        self._proc.start()
        child.close()
        self.alive = True
        self._finalizer = weakref.finalize(self, _stop, self._conn, self._proc)

    def call(self, method: str, request: dict[str, Any], extra_s: float = 0.0) -> Any:
        """Send `request`, return the worker's answer; any failure is an `EnvFailure` naming `method`. The
        worker has the step deadline plus `GRACE_S` and `extra_s` to answer (no step deadline: forever)."""
        if not self.alive:
            raise EnvFailure(EnvError(self.name, method, "WorkerGone: the worker had already stopped"))
        deadline = None if self.timeout is None else self.timeout + GRACE_S + extra_s
        try:
            self._conn.send_bytes(dumps(request))
            if not self._conn.poll(deadline):
                self.kill()
                raise EnvFailure(
                    EnvError(
                        self.name, method, f"Timeout: no answer within {deadline:g}s; the worker was stopped"
                    )
                )
            data = self._conn.recv_bytes(MAX_REPLY_BYTES)
        except (EOFError, OSError) as exc:  # the worker died, or sent more than MAX_REPLY_BYTES
            self.kill()
            text = _exit_text(self._proc.exitcode)
            if not isinstance(exc, EOFError | BrokenPipeError | ConnectionResetError):
                text = f"WireError: a reply over {MAX_REPLY_BYTES} bytes, or unreadable ({exc})"
            raise EnvFailure(EnvError(self.name, method, text)) from None
        except BaseException:  # Ctrl-C while waiting: a late reply would answer the next request, so stop it
            self.kill()
            raise
        try:
            reply = loads(data)
            if not isinstance(reply, dict) or not ("ok" in reply or "error" in reply):
                raise WireError("a reply without 'ok' or 'error'")
        except WireError as exc:
            self.kill()
            raise EnvFailure(EnvError(self.name, method, f"WireError: {exc}")) from None
        if "error" in reply:
            raise EnvFailure(_error_from_wire(self.name, reply["error"]))
        return reply["ok"]

    def kill(self) -> None:
        """Stop the worker at once (it is unusable afterwards)."""
        self.alive = False
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5.0)

    def close(self) -> None:
        """Ask the worker to exit, then make sure it has."""
        self.alive = False
        self._finalizer()


def _stop(conn: Connection, proc: BaseProcess) -> None:
    with contextlib.suppress(OSError):
        conn.send_bytes(dumps({"op": "stop"}))
    proc.join(2.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)
    conn.close()


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
    """An environment living in an `EnvWorker`, by handle. See the module docstring."""

    def __init__(
        self, worker: EnvWorker, handle: int, rubric_names: Sequence[str], class_name: str = ""
    ) -> None:
        self.worker, self.handle = worker, handle
        self.class_name = class_name or worker.name
        """The environment's own class name (in the worker)."""
        self._rubrics = tuple(rubric_names)
        self._tools: tuple[ToolSpec, ...] = ()

    def _call(self, method: str, op: str, **fields: Any) -> Any:
        reply = self.worker.call(method, {"op": op, "handle": self.handle, **fields})
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
            f"rubric {rubric!r}", "score", rubric=rubric, messages=messages_to_wire(episode.messages),
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
                self.worker.call("release", {"op": "release", "handles": [self.handle]})


class WorkerEnvFactory:
    """`make_env(name, **kwargs)`, but each environment is built in a worker process. One worker serves
    every environment of the factory, one request at a time; a failed worker is replaced on the next call.
    `timeout` (the step deadline) bounds how long any request may take, plus `GRACE_S`."""

    def __init__(
        self, name: str, kwargs: Mapping[str, Any] | None = None, timeout: float | None = 30.0
    ) -> None:
        self.name, self.kwargs, self.timeout = name, dict(kwargs or {}), timeout
        self._worker: EnvWorker | None = None

    def __call__(self) -> RemoteEnv:
        if self._worker is None or not self._worker.alive:
            if self._worker is not None:
                self._worker.close()
            self._worker = EnvWorker(self.name, self.kwargs, self.timeout)
        reply = self._worker.call("__init__", {"op": "new"}, extra_s=BUILD_S)
        if not isinstance(reply, dict) or not isinstance(reply.get("handle"), int):
            raise EnvFailure(EnvError(self.name, "__init__", "WireError: no handle in the reply"))
        try:
            names = names_from_wire(reply.get("rubrics"), "rubric names")
        except WireError as exc:
            raise EnvFailure(EnvError(self.name, "rubrics", f"WireError: {exc}")) from None
        class_name = reply.get("class")
        return RemoteEnv(self._worker, reply["handle"], names, str(class_name)[:MAX_NAME_CHARS])

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
