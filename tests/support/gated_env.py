"""An environment whose steps can be held at a gate, for the concurrency tests (tests/envs/test_env_concurrency.py).

It runs in an environment worker, so the test steers it through files in `gates` (a directory): a step
`wait:NAME` writes `NAME.started` and blocks until the test writes `NAME.go` (at most `GATE_S` seconds);
any other step writes `<its text>.started` and answers at once. Each environment keeps a log of what it
stepped, and every answer is that log, so a step that ran out of order, or on another handle's state, shows
in what comes back. `exit` calls `os._exit(0)`, `sys.exit` calls `sys.exit(3)`; `block` never returns; `spin:N` counts to N in Python
(CPU-bound, holding the interpreter)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from envs import Environment, Episode, Message, Rubric, StepResult

GATE_S = 20.0
"""Longest a gated step waits for its gate (a test that never opens it still ends)."""


def touch(path: Path) -> None:
    path.write_text("")


def wait_for(predicate, seconds: float = GATE_S) -> bool:  # type: ignore[no-untyped-def]
    """Poll `predicate` until it holds (True) or `seconds` pass (False)."""
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


class LogLength(Rubric):
    def score(self, episode: Episode) -> float:
        state = episode.state
        assert isinstance(state, tuple)
        return len(state) / 100


class GatedEnv(Environment):
    def __init__(self, gates: str) -> None:
        self.gates = Path(gates)
        self.log: list[str] = []

    def reset(self, seed: int) -> Sequence[Message]:
        self.log = [f"seed{seed}"]
        return (Message("user", f"Step ({seed})."),)

    def step(self, message: Message) -> StepResult:
        text = message.content
        if text == "exit":
            os._exit(0)
        if text == "sys.exit":
            sys.exit(3)
        if text == "block":
            threading.Event().wait()
        if text.startswith("spin:"):
            total = sum(range(int(text[5:])))
            self.log.append(f"spun{total % 7}")
        elif text.startswith("wait:"):
            name = text[5:]
            self.log.append(f"{name}-start")
            touch(self.gates / f"{name}.started")
            wait_for((self.gates / f"{name}.go").exists)
            self.log.append(f"{name}-end")
        else:
            self.log.append(text)
            touch(self.gates / f"{text}.started")
        return StepResult((Message("user", "|".join(self.log)),))

    def state(self) -> tuple[str, ...]:
        return tuple(self.log)

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"length": LogLength()}
