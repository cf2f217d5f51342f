"""An environment whose `step` blocks in its step thread, for the SIGINT test (tests/train/test_sigint_step.py).

With `BLOCKING_ENV_MARKER` set, the first `step` prints that marker line to stderr and then blocks for
good, as a hung tool would (the wrapper runs steps in a worker thread under `rollout.episode.step_timeout_s`).
Without it every step ends the episode at once, so the same run can be resumed."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence

from envs import Environment, Episode, Message, Rubric, StepResult


class Length(Rubric):
    """Reward = characters the agent wrote, capped: varies between episodes, so groups have variance."""

    def score(self, episode: Episode) -> float:
        return min(1.0, sum(len(m.content) for m in episode.messages if m.role == "assistant") / 40)


class BlockingStepEnv(Environment):
    def reset(self, seed: int) -> Sequence[Message]:
        return (Message("user", f"Say anything ({seed})."),)

    def step(self, message: Message) -> StepResult:
        marker = os.environ.get("BLOCKING_ENV_MARKER")
        if marker:
            print(marker, file=sys.stderr, flush=True)
            threading.Event().wait()  # never set: blocks like a hung tool
        return StepResult(done=True)

    def state(self) -> int:
        return 0

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"length": Length()}
