"""One environment step under a deadline, in a thread, on a copy that is adopted only on success.

A step abandoned at its deadline keeps running in its thread (Python cannot kill a thread), so it must not
mutate the state the episode continues from: the step runs on a deep copy, and the caller keeps the
original when the deadline passes. The abandoned thread is sent `StepAbandoned`, which stops a tool stuck
in a Python loop; a blocking call (sleep, I/O) ends when it returns. The token wrapper uses this for an
environment in the trainer's own process, and an environment worker for the environments it hosts.

Example:
    >>> from envs.protocol import Environment, Message, StepResult
    >>> class Count(Environment):
    ...     n = 0
    ...     def reset(self, seed): return (Message("user", "go"),)
    ...     def step(self, message):
    ...         self.n += 1
    ...         return StepResult(done=True)
    >>> env = Count()
    >>> adopted, result = step_within(env, Message("assistant", "hi"), 5.0, lambda e, m: e.step(m))
    >>> (env.n, adopted.n, result.done)
    (0, 1, True)
"""

from __future__ import annotations

import copy
import ctypes
import threading
from abc import abstractmethod
from collections.abc import Callable
from typing import TypeVar

from envs.protocol import Environment, Message, StepResult
from envs.tools import StepAbandoned

_E = TypeVar("_E")


class DeadlineEnvironment(Environment):
    """An environment that keeps the step deadline itself (one hosted in a worker process), so the token
    wrapper neither copies nor threads it."""

    @abstractmethod
    def step_within(self, message: Message, timeout: float | None) -> StepResult | None:
        """The step's result, or None when it did not answer within `timeout` seconds (the environment
        then keeps its pre-step state)."""

    def step(self, message: Message) -> StepResult:
        result = self.step_within(message, None)
        assert result is not None
        return result


def abandon(worker: threading.Thread) -> None:
    """Ask a step thread past its deadline to stop (raises `StepAbandoned` inside it)."""
    if worker.ident is not None and worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(worker.ident), ctypes.py_object(StepAbandoned)
        )


def step_within(
    env: _E, message: Message, timeout: float, call: Callable[[_E, Message], StepResult], name: str = "env"
) -> tuple[_E, StepResult] | None:
    """`call(copy_of_env, message)` in a thread: (the stepped copy, its result), or None when it did not
    answer within `timeout` seconds. `copy.deepcopy(env)` errors and the step's own exceptions propagate."""
    candidate = copy.deepcopy(env)
    box: list[StepResult | BaseException] = []

    def run() -> None:
        try:
            box.append(call(candidate, message))
        except StepAbandoned:
            pass
        except BaseException as exc:
            box.append(exc)

    worker = threading.Thread(target=run, name=f"{name}-step", daemon=True)
    worker.start()
    worker.join(timeout)
    if not box:
        abandon(worker)
        return None
    if isinstance(box[0], BaseException):
        raise box[0]
    return candidate, box[0]
