"""Small scripted environments with known dynamics, free of torch so an environment worker process can
import them quickly (tests/support/env_fixtures.py re-exports them next to the model helpers)."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence

from envs import Environment, Episode, Message, Rubric, StepResult, Tool, ToolEnv


class TurnCount(Rubric):
    """Reward = assistant turns / 10, capped at 1 (a rubric that depends on the episode only)."""

    def score(self, episode: Episode) -> float:
        return min(1.0, sum(m.role == "assistant" for m in episode.messages) / 10)


class FixedTurnsEnv(Environment):
    """Answers every assistant turn with a user message until `turns` turns, whatever was said."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns
        self.count = 0

    def reset(self, seed: int) -> Sequence[Message]:
        self.count = 0
        return (Message("user", f"Say anything ({seed})."),)

    def step(self, message: Message) -> StepResult:
        self.count += 1
        if self.count >= self.turns:
            return StepResult(done=True)
        return StepResult((Message("user", f"turn {self.count} ok"),))

    def state(self) -> int:
        return self.count

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"turns": TurnCount()}


class NoisyEnv(FixedTurnsEnv):
    """Like FixedTurnsEnv, but each fork draws its own noise, so environment branches differ."""

    def __init__(self, turns: int = 2, noise_seed: int = 0) -> None:
        super().__init__(turns)
        self.noise_seed = noise_seed
        self.rng = random.Random(noise_seed)

    def step(self, message: Message) -> StepResult:
        result = super().step(message)
        if result.done:
            return result
        return StepResult((Message("user", f"noise {self.rng.randint(0, 10**6)}"),))

    def fork(self, branch: int = 0) -> NoisyEnv:
        twin = super().fork(branch)
        twin.rng = random.Random(f"{self.noise_seed}/{self.count}/{branch}")
        return twin


class FlakyToolsEnv(ToolEnv):
    """Tools that fail in every way: raise, sleep past the timeout, or work."""

    def reset(self, seed: int) -> Sequence[Message]:
        return (Message("user", "Use the tools."),)

    def ok(self, x: int) -> str:
        """Return x doubled."""
        return str(2 * x)

    def boom(self) -> str:
        """Always raises."""
        raise RuntimeError("the tool exploded")

    def slow(self, seconds: float) -> str:
        """Sleep, then answer."""
        time.sleep(seconds)
        return "slept"

    def tools(self) -> Sequence[Tool]:
        return tuple(Tool.from_function(f) for f in (self.ok, self.boom, self.slow))

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"turns": TurnCount()}


class FailsOnSeedEnv(FixedTurnsEnv):
    """Like FixedTurnsEnv, but the episodes of task seed `seed` raise on their second step."""

    def __init__(self, seed: int = 1, turns: int = 3) -> None:
        super().__init__(turns)
        self.fail_seed = seed
        self.seed = -1

    def reset(self, seed: int) -> Sequence[Message]:
        self.seed = seed
        return super().reset(seed)

    def step(self, message: Message) -> StepResult:
        if self.seed == self.fail_seed and self.count == 1:
            raise ValueError("boom")
        return super().step(message)


class DigitFraction(Rubric):
    """Reward = the fraction of the assistant's characters that are digits: a random-init policy's turns
    differ in it, so every group has reward variance and every update steps."""

    def score(self, episode: Episode) -> float:
        text = "".join(m.content for m in episode.messages if m.role == "assistant")
        return sum(c.isdigit() for c in text) / max(1, len(text))


class DigitsToolEnv(ToolEnv):
    """One turn with a tool on offer (`double`), rewarded by `DigitFraction`."""

    def reset(self, seed: int) -> Sequence[Message]:
        return (Message("user", f"Write some digits ({seed}), or double a number with the tool."),)

    def double(self, x: int) -> str:
        """Return x doubled."""
        return str(2 * x)

    def tools(self) -> Sequence[Tool]:
        return (Tool.from_function(self.double),)

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"digits": DigitFraction()}
