"""Calculator: evaluate a random integer expression, with a `calculate` tool; the answer is verifiable.

A task is an expression of 3-5 two-digit integers joined by + - * (parenthesised at random), drawn from the
seed. The agent may call `calculate(expression)` any number of times and ends by replying with the number.
Two rubrics score the same episode: `exact` (1 if the last number in the final answer is right) and
`efficient` (`exact`, minus 0.25 for each tool call beyond the first, floored at 0).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from envs.calculator.arith import evaluate, format_number
from envs.protocol import Episode, Message, Rubric
from envs.tools import Tool, ToolEnv

SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculate tool for arithmetic. "
    "When you know the result, reply with the final answer as a single number."
)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class CalculatorTask:
    """One task: the expression shown to the agent and its integer value."""

    expression: str
    answer: int


def make_task(seed: int, min_operands: int = 2, max_operands: int = 3) -> CalculatorTask:
    """A random task; the same seed always gives the same task."""
    rng = random.Random(seed)
    expr = str(rng.randint(2, 99))
    for _ in range(rng.randint(min_operands, max_operands) - 1):
        expr = f"{expr} {rng.choice('+-*')} {rng.randint(2, 99)}"
        if rng.random() < 0.3:
            expr = f"({expr})"
    value = evaluate(expr)
    assert isinstance(value, int)
    return CalculatorTask(expr, value)


def final_answer(episode: Episode) -> float | None:
    """The last number in the final assistant message, or None when the episode did not end on an answer."""
    if episode.finish != "done":
        return None
    answers = [m for m in episode.messages if m.role == "assistant" and not m.tool_calls]
    if not answers:
        return None
    numbers = _NUMBER.findall(answers[-1].content)
    return float(numbers[-1]) if numbers else None


def _task(episode: Episode) -> CalculatorTask:
    if not isinstance(episode.state, CalculatorTask):
        raise TypeError(f"calculator rubric got state {episode.state!r}")
    return episode.state


class ExactAnswer(Rubric):
    """1.0 when the final answer equals the task's value, else 0.0."""

    def score(self, episode: Episode) -> float:
        return float(final_answer(episode) == _task(episode).answer)


class EfficientAnswer(Rubric):
    """`ExactAnswer`, minus `penalty` per tool call beyond the first, floored at 0."""

    def __init__(self, penalty: float = 0.25) -> None:
        self.penalty = penalty

    def score(self, episode: Episode) -> float:
        calls = sum(len(m.tool_calls) for m in episode.messages if m.role == "assistant")
        return max(0.0, ExactAnswer().score(episode) - self.penalty * max(0, calls - 1))


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool. `min_operands`/`max_operands` set the expression size."""

    def __init__(self, min_operands: int = 2, max_operands: int = 3) -> None:
        if not 2 <= min_operands <= max_operands:
            raise ValueError(f"need 2 <= min_operands <= max_operands, got {min_operands}, {max_operands}")
        self.min_operands, self.max_operands = min_operands, max_operands
        self.task: CalculatorTask | None = None

    def reset(self, seed: int) -> Sequence[Message]:
        self.task = make_task(seed, self.min_operands, self.max_operands)
        return (Message("system", SYSTEM_PROMPT), Message("user", f"What is {self.task.expression}?"))

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression with numbers, + - * / and parentheses."""
        return format_number(evaluate(expression))

    def tools(self) -> Sequence[Tool]:
        return (Tool.from_function(self.calculate),)

    def state(self) -> CalculatorTask | None:
        return self.task

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"exact": ExactAnswer(), "efficient": EfficientAnswer()}
