"""Lookup: answer a question about a long inventory table, with a `lookup` tool for what it omits.

The prompt holds the whole table (hundreds of rows by default) and asks for the city of the warehouse
that stores one named item. The agent must find the item's row, call `lookup(code)` with its warehouse
code, and reply with the city. Rubrics: `exact` (the final answer names the right city and no other
known city) and `grounded` (`exact`, and the right code was looked up).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from envs.lookup.table import CITIES, Table, make_table
from envs.protocol import Episode, Immutable, Message, Rubric
from envs.tools import Tool, ToolEnv

SYSTEM_PROMPT = (
    "You answer questions about the inventory document below. Warehouse cities are not in the document: "
    "use the lookup tool with a warehouse code. Reply with the city name only."
)


@dataclass(frozen=True)
class LookupTask(Immutable):
    """One task: the table, the item asked about, and the expected city and code."""

    table: Table
    item_name: str
    code: str
    answer: str


def _task(episode: Episode) -> LookupTask:
    if not isinstance(episode.state, LookupTask):
        raise TypeError(f"lookup rubric got state {episode.state!r}")
    return episode.state


class ExactCity(Rubric):
    """1.0 when the final answer mentions the right city and no other city, else 0.0."""

    def score(self, episode: Episode) -> float:
        task = _task(episode)
        if episode.finish != "done":
            return 0.0
        answers = [m.content for m in episode.messages if m.role == "assistant" and not m.tool_calls]
        if not answers:
            return 0.0
        mentioned = {c for c in CITIES if re.search(rf"\b{c}\b", answers[-1], re.IGNORECASE)}
        return float(mentioned == {task.answer})


class GroundedCity(Rubric):
    """`ExactCity`, counted only when the agent looked up the right warehouse code."""

    def score(self, episode: Episode) -> float:
        task = _task(episode)
        looked_up = any(
            c.name == "lookup" and c.arguments.get("code") == task.code
            for m in episode.messages
            if m.role == "assistant"
            for c in m.tool_calls
        )
        return ExactCity().score(episode) if looked_up else 0.0


class LookupEnv(ToolEnv):
    """Long-context table QA with a lookup tool. `num_rows` sets the document length."""

    def __init__(self, num_rows: int = 200, num_warehouses: int = 40) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        self.num_rows, self.num_warehouses = num_rows, num_warehouses
        self.task: LookupTask | None = None

    def reset(self, seed: int) -> Sequence[Message]:
        table = make_table(seed, self.num_rows, self.num_warehouses)
        row = random.Random(seed).choice(table.rows)
        self.task = LookupTask(table, row.name, row.warehouse, table.city_of(row.warehouse))
        question = f"In which city is the warehouse that stores the {row.name}?"
        return (Message("system", f"{SYSTEM_PROMPT}\n\n{table.render()}"), Message("user", question))

    def lookup(self, code: str) -> str:
        """Return the city of the warehouse with this code (for example W123)."""
        if self.task is None:
            raise RuntimeError("lookup called before reset")
        return f"{code}: {self.task.table.city_of(code.strip())}"

    def tools(self) -> Sequence[Tool]:
        return (Tool.from_function(self.lookup),)

    def state(self) -> LookupTask | None:
        return self.task

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"exact": ExactCity(), "grounded": GroundedCity()}
