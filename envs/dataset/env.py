"""`DatasetEnv`: tasks from a file of rows, scored by the `answer` comparison or a user's function.

`--set env.name=dataset --set env.kwargs.path=tasks.jsonl` trains on the rows of `tasks.jsonl`; every
setting is a JSON value, so the environment travels to the worker processes as any other. A row opens with
its `prompt` (after `system_prompt`, when given) or its `messages`; the episode ends at the first assistant
turn without tool calls, whose text the reward scores (`envs.dataset.answers`).

Tools are none by default; `tools` names a `ToolEnv` subclass (`module:Class`, built once per environment
with `tool_kwargs`, whose `tools()` the agent gets and whose state forks with the episode) or a list of
functions (`module:function`, each described by its signature and docstring, `envs.tools.Tool`).

Example:
    >>> env = DatasetEnv("tests/assets/tasks.jsonl", eval_fraction=0.25)
    >>> env.reset(0)[-1].role, env.held_out_count() > 0
    ('user', True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from envs.dataset.answers import load_callable, make_reward
from envs.dataset.draws import draw, tables
from envs.dataset.rows import TaskFileError, TaskRow
from envs.protocol import Message, Rubric
from envs.tools import Tool, ToolEnv

SPLITS = ("train", "eval")


def _tool_source(
    tools: str | Sequence[str] | None, tool_kwargs: Mapping[str, Any]
) -> ToolEnv | tuple[Tool, ...]:
    if tools is None:
        return ()
    if isinstance(tools, str):
        target = load_callable(tools, "tools")
        if isinstance(target, type):
            if not issubclass(target, ToolEnv):
                raise ValueError(f"tools: {tools!r} is a class but not a subclass of envs.ToolEnv")
            return target(**tool_kwargs)
        tools = [tools]
    elif tool_kwargs:
        raise ValueError("tool_kwargs: only for a ToolEnv class named by tools, not a list of functions")
    if not isinstance(tools, list | tuple) or not all(isinstance(t, str) for t in tools):
        raise ValueError(
            f"tools: must be 'module:Class', 'module:function' or a list of those, got {tools!r:.80}"
        )
    found = []
    for target_name in tools:
        fn = load_callable(target_name, "tools")
        if isinstance(fn, type) or not callable(fn):
            raise ValueError(f"tools: {target_name!r} in a list must be a function")
        found.append(Tool.from_function(fn))
    names = [t.spec.name for t in found]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: two tools share a name: {names}")
    return tuple(found)


class DatasetEnv(ToolEnv):
    """Tasks from the rows of a local file; see the module docstring and docs/environments.md."""

    def __init__(
        self,
        path: str,
        reward: str = "answer",
        tools: str | list[str] | None = None,
        tool_kwargs: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        eval_fraction: float = 0.0,
        eval_path: str | None = None,
        split: Literal["train", "eval"] = "train",
    ) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"path: must name a local task file, got {path!r:.80}")
        if split not in SPLITS:
            raise ValueError(f"split: must be one of {SPLITS}, got {split!r:.40}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError("system_prompt: must be text or null")
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, int | float):
            raise ValueError(f"eval_fraction: must be a number in [0, 1), got {eval_fraction!r:.40}")
        self.rubric, self.reward_name = make_reward(reward), reward
        needs = ("answer",) if reward == "answer" else ()
        try:
            self.tables = tables(path, eval_path, float(eval_fraction), needs)
        except TaskFileError as exc:  # a ValueError in the worker's reply: the refusal names env.kwargs
            raise ValueError(str(exc)) from None
        self.split, self.system_prompt = split, system_prompt
        self.indices = self.tables.split.held_out if split == "eval" else self.tables.split.train
        if not self.indices:
            raise ValueError("split: 'eval' needs held-out rows; set eval_fraction or eval_path")
        self.source = _tool_source(tools, dict(tool_kwargs or {}))
        self.row: TaskRow | None = None

    def held_out_count(self) -> int:
        """How many rows are held out for evaluation (0: no held-out split)."""
        return len(self.tables.split.held_out)

    def reset(self, seed: int) -> Sequence[Message]:
        index = self.indices[seed % len(self.indices)] if self.split == "eval" else draw(self.indices, seed)
        self.row = self.tables.rows[index]
        if isinstance(self.source, ToolEnv):
            self.source.reset(seed)
        return self.row.opening(self.system_prompt)

    def tools(self) -> Sequence[Tool]:
        return self.source.tools() if isinstance(self.source, ToolEnv) else self.source

    def state(self) -> TaskRow | None:
        return self.row

    def rubrics(self) -> Mapping[str, Rubric]:
        return {self.reward_name: self.rubric}
