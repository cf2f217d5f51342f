"""A reward function and tools named by `module:name` in the dataset environment's tests (imported in the
environment's worker process as any user module would be)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envs import Episode


def shorter_is_better(episode: Episode, row: Mapping[str, Any]) -> float:
    """1 / (1 + characters of the final reply), and 0 when the row says `"skip": true`."""
    finals = [m.content for m in episode.messages if m.role == "assistant" and not m.tool_calls]
    if row.get("skip") or not finals:
        return 0.0
    return 1.0 / (1.0 + len(finals[-1]))


def not_a_number(episode: Episode, row: Mapping[str, Any]) -> object:
    """A reward that returns text (refused when it scores)."""
    return "high"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def negate(x: int) -> int:
    """Negate an integer."""
    return -x
