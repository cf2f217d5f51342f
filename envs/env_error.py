"""What failed in one task's episode: `EnvError` (one line and a traceback) and `EnvFailure`, its exception.

Environment code that fails in a worker arrives as an `EnvFailure` (`envs.remote`); a failure on the
trainer's side of one episode (a prompt longer than the budget, a chat template that refuses the
conversation, any exception in the token wrapper) becomes the same `EnvError` through `EnvError.raised`, so
the rollout ends that task alone, counts it and writes its traceback the same way (`env-errors/`).

This module imports neither the worker process's code nor the channel to it, so the rollout scheduler can
name a failure without pulling them in.

Example:
    >>> try:
    ...     raise ValueError("prompt too long")
    ... except ValueError as exc:
    ...     error = EnvError.raised("calculator", "reset", exc)
    >>> error.method, error.exception, "Traceback" in error.traceback
    ('reset', 'ValueError: prompt too long', True)
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from dataclasses import dataclass

from envs.wire import MAX_NAME_CHARS, MAX_TRACEBACK_CHARS
from envs.wrapper import EnvStepError


def summary(exc: BaseException) -> str:
    """`Type: message` on one line, bounded."""
    try:
        text = str(exc)
    except Exception:
        text = "<str() raised>"
    line = " ".join(f"{type(exc).__name__}: {text}".split()) if text else type(exc).__name__
    return line[:MAX_NAME_CHARS]


_NOT_THEIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)


def raised_at(exc: BaseException) -> str:
    """The innermost frame of the traceback outside this package and the standard library: the environment's
    own line (none when its code only returned something wrong, or the standard library refused it)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_NOT_THEIRS)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


@dataclass(frozen=True)
class EnvError:
    """One failure of one task's episode: which environment, which method, what was raised, and where."""

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

    @classmethod
    def raised(cls, env: str, method: str, exc: BaseException) -> EnvError:
        """The failure `exc` is, raised in this process during `method` of an episode of `env` (an
        `EnvFailure` keeps the error it carries)."""
        if isinstance(exc, EnvFailure):
            return exc.error
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(env, method, summary(exc), raised_at(exc), trace[-MAX_TRACEBACK_CHARS:])


class EnvFailure(EnvStepError):
    """Environment code failed (in a worker); `error` says how."""

    def __init__(self, error: EnvError) -> None:
        super().__init__(error.line())
        self.error = error
