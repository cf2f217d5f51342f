"""Tool code can never crash an episode: every kind of hostile tool becomes a tool message."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from decimal import Decimal

import pytest
from support.env_fixtures import END, TurnCount, encode, tokenizer

from envs import EpisodeLimits, Message, Rubric, TokenEnv, Tool, ToolEnv, WrapperConfig, format_tool_call

SPINNING: list[threading.Thread] = []


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class BadMessage(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message either")


class HostileEnv(ToolEnv):
    """One tool per way tool code goes wrong, plus a working one."""

    def reset(self, seed: int) -> Sequence[Message]:
        return (Message("user", "Use the tools."),)

    def decimal(self) -> Decimal:
        """A value json cannot serialize."""
        return Decimal("12.50")

    def nested(self) -> dict:
        """A dict holding a non-JSON value."""
        return {"total": Decimal("3.25"), "items": {1, 2}}

    def unprintable(self) -> object:
        """A value whose str() raises."""
        return Unprintable()

    def huge(self, n: int) -> str:
        """n characters."""
        return "x" * n

    def raises(self) -> str:
        """An ordinary exception."""
        raise ValueError("bad input")

    def raises_badly(self) -> str:
        """An exception whose message cannot be printed."""
        raise BadMessage

    def exits(self) -> str:
        """Calls sys.exit."""
        sys.exit(3)

    def sleeps(self) -> str:
        """Blocks past the timeout."""
        time.sleep(1.0)
        return "woke"

    def hangs(self) -> str:
        """Spins forever in Python code."""
        SPINNING.append(threading.current_thread())
        while True:
            with contextlib.suppress(Exception):  # a tool that swallows every Exception still stops
                sum(range(1000))

    def ok(self, x: int) -> int:
        """Doubles x."""
        return 2 * x

    def tools(self) -> Sequence[Tool]:
        fns = (self.decimal, self.nested, self.unprintable, self.huge, self.raises, self.raises_badly)
        fns += (self.exits, self.sleeps, self.hangs, self.ok)
        return tuple(Tool.from_function(f) for f in fns)

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"turns": TurnCount()}


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (("decimal", {}), "12.50"),
        (("nested", {}), "{'total': Decimal('3.25'), 'items': {1, 2}}"),
        (("unprintable", {}), "Error: the tool returned a Unprintable whose str() raised RuntimeError"),
        (("huge", {"n": 110}), "x" * 100 + "\n[... 10 more characters truncated]"),
        (("raises", {}), "Error: tool 'raises' raised ValueError: bad input"),
        (
            ("raises_badly", {}),
            "Error: tool 'raises_badly' raised BadMessage: <BadMessage whose str() raised",
        ),
        (("exits", {}), "Error: tool 'exits' raised SystemExit: 3"),
        (("sleeps", {}), "Error: tool 'sleeps' timed out after 0.3s."),
        (("hangs", {}), "Error: tool 'hangs' timed out after 0.3s."),
    ],
)
def test_hostile_tool_becomes_a_tool_message(call: tuple[str, dict], expected: str) -> None:
    env = TokenEnv(
        HostileEnv(),
        tokenizer(),
        WrapperConfig(EpisodeLimits(max_turns=5, step_timeout_s=0.3), max_tool_result_chars=100),
    )
    env.reset(0)
    result = env.step(encode(format_tool_call(*call) + END))
    assert not result.done and [m.role for m in result.messages] == ["tool"]
    assert result.messages[0].content.startswith(expected)
    assert expected in env.template.decode(result.observation)
    # Control: the same episode goes on, a working tool answers, and the episode ends normally.
    assert env.step(encode(format_tool_call("ok", {"x": 4}) + END)).messages[0].content == "8"
    assert env.step(encode("done" + END)).done
    assert env.trajectory("t").reward == pytest.approx(0.3)


def test_a_hung_tool_thread_is_stopped() -> None:
    SPINNING.clear()
    env = TokenEnv(HostileEnv(), tokenizer(), WrapperConfig(EpisodeLimits(step_timeout_s=0.2)))
    env.reset(0)
    env.step(encode(format_tool_call("hangs", {}) + END))
    (thread,) = SPINNING
    thread.join(5.0)
    assert not thread.is_alive()


def test_results_within_the_limit_are_untouched() -> None:
    env = TokenEnv(HostileEnv(), tokenizer(), WrapperConfig(max_tool_result_chars=50))
    env.reset(0)
    assert env.step(encode(format_tool_call("huge", {"n": 50}) + END)).messages[0].content == "x" * 50
