"""An environment with one fault at a time, for tests/train/test_env_failures.py (through the CLI).

`fault` picks the misbehaviour; `seeds` says on which tasks: "all", "odd" (task seeds 1, 3, ...: one
task of each update with two tasks per update) or "even" (task seeds 0, 2, ...: the other one, the first
task the trainer's start-up checks open). Without a fault every step ends the episode, and the reward
is the length of what the agent wrote, so groups have reward variance.

The model is a tiny random one that never writes a valid tool call, so faults that real environments hit
in tool code (`os._exit`, closing stdout) are raised in `step` itself, which is where tool code runs.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from envs import Environment, Episode, Message, Rubric, StepResult

_STDOUT = threading.Lock()
"""Steps of one worker run in concurrent threads: the check-then-close must be one step, or a second
thread would print to, or close, a stdout that another has just closed (its own failure, not the fault's)."""


class Length(Rubric):
    def __init__(self, fault: str, hit: bool) -> None:
        self.fault, self.hit = fault, hit

    def score(self, episode: Episode) -> float:
        if self.hit and self.fault == "nan":
            return math.nan
        if self.hit and self.fault == "inf":
            return math.inf
        if self.hit and self.fault == "slow_rubric":  # a judge slower than rollout.rubric_timeout_s
            time.sleep(float(os.environ.get("MISBEHAVING_SLEEP_S", "2")))
        return min(1.0, sum(len(m.content) for m in episode.messages if m.role == "assistant") / 40)


class Misbehaving(Environment):
    def __init__(self, fault: str = "none", seeds: str = "all") -> None:
        if fault == "init":
            raise RuntimeError("init fault")
        self.fault, self.seeds, self.seed = fault, seeds, 0
        self.lock = threading.Lock() if fault == "nocopy" else None  # a lock cannot be deep-copied

    def _hit(self) -> bool:
        return self.seeds == "all" or self.seed % 2 == (0 if self.seeds == "even" else 1)

    def reset(self, seed: int) -> Sequence[Message]:
        self.seed = seed
        if self._hit() and self.fault == "reset":
            raise RuntimeError("reset fault")
        if self._hit() and self.fault == "reset_none":
            return None  # type: ignore[return-value]
        if self._hit() and self.fault == "long_prompt":  # longer than any episode budget
            return (Message("user", "word " * 20000),)
        return (Message("user", f"Say anything ({seed})."),)

    def step(self, message: Message) -> StepResult:
        if self._hit():
            if self.fault == "step":
                raise RuntimeError("step fault")
            if self.fault == "step_dict":
                return {"done": True}  # type: ignore[return-value]
            if self.fault == "exit":
                os._exit(0)
            if self.fault == "slow_step":  # past rollout.episode.step_timeout_s: a timeout observation
                time.sleep(float(os.environ.get("MISBEHAVING_SLEEP_S", "2")))
            if self.fault == "close_stdout":
                with _STDOUT:
                    if not sys.stdout.closed:  # once per worker process
                        print("closing stdout", flush=True)
                        sys.stdout.close()
                        os.close(1)
        return StepResult(done=True)

    def state(self) -> int:
        return self.seed

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"length": Length(self.fault, self._hit())}
