"""A custom environment as a third-party package would write it (the README's ~30-line example).

The agent must repeat a random word; it may call `shout` to see the word in capitals. Two rubrics
score the same episode.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from envs import Episode, Message, Rubric, Tool, ToolEnv


class Echoed(Rubric):
    """1.0 when the final answer is exactly the word."""

    def score(self, episode: Episode) -> float:
        final = [m.content for m in episode.messages if m.role == "assistant" and not m.tool_calls]
        return float(episode.finish == "done" and bool(final) and final[-1].strip() == episode.state)


class Shouted(Rubric):
    """1.0 when the agent called `shout` at least once."""

    def score(self, episode: Episode) -> float:
        return float(any(c.name == "shout" for m in episode.messages for c in m.tool_calls))


class EchoEnv(ToolEnv):
    """Repeat the word back."""

    def __init__(self, words: Sequence[str] = ("apple", "river", "cloud")) -> None:
        self.words = tuple(words)
        self.word = ""

    def reset(self, seed: int) -> Sequence[Message]:
        self.word = random.Random(seed).choice(self.words)
        return (Message("user", f"Repeat this word exactly: {self.word}"),)

    def shout(self, text: str) -> str:
        """Return the text in capital letters."""
        return text.upper()

    def tools(self) -> Sequence[Tool]:
        return (Tool.from_function(self.shout),)

    def state(self) -> str:
        return self.word

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"echoed": Echoed(), "shouted": Shouted()}


class NotAnEnvironment:
    """Registered by mistake: the registry must refuse it with a clear error."""
