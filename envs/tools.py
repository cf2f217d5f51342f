"""Tools as plain Python functions, their safe execution, and `ToolEnv`, the usual environment shape.

`Tool.from_function` reads a function's signature and docstring to build its `ToolSpec` (JSON Schema
types from the annotations), so a tool is just a typed method. `execute_tool_call` runs one call and always
returns a `tool` message: an unknown tool, arguments that do not fit the signature, and an exception
inside the tool all become an `Error: ...` observation that the agent sees. Timeouts are enforced one
level up, by the token-level wrapper, which owns all budgets.

Example:
    >>> def add(a: int, b: int) -> int:
    ...     '''Add two integers.'''
    ...     return a + b
    >>> tool = Tool.from_function(add)
    >>> tool.spec.parameters["required"]
    ['a', 'b']
    >>> execute_tool_call({"add": tool}, ToolCall("c0", "add", {"a": 2, "b": 3})).content
    '5'
    >>> execute_tool_call({"add": tool}, ToolCall("c1", "mul", {})).content
    "Error: unknown tool 'mul'. Available tools: add."
"""

from __future__ import annotations

import inspect
import json
import typing
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envs.protocol import Environment, Message, ProtocolError, StepResult, ToolCall, ToolSpec

_JSON_TYPES: dict[type, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


_CHECKED_TYPES = frozenset(_JSON_TYPES.values())


def _matches(value: object, json_type: str) -> bool:
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    py = {"string": str, "boolean": bool, "array": list, "object": dict}[json_type]
    return isinstance(value, py)


@dataclass(frozen=True)
class Tool:
    """A callable tool and the spec shown to the model."""

    spec: ToolSpec
    fn: Callable[..., object]

    @staticmethod
    def from_function(
        fn: Callable[..., object], name: str | None = None, description: str | None = None
    ) -> Tool:
        """Build a tool from a function with annotated parameters (str, int, float, bool, list, dict)."""
        tool_name = name or str(getattr(fn, "__name__", ""))
        hints = typing.get_type_hints(fn)
        properties: dict[str, dict[str, str]] = {}
        required: list[str] = []
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ProtocolError(f"tool {tool_name!r}: *args/**kwargs cannot be described to the model")
            json_type = _JSON_TYPES.get(hints.get(pname, object))
            if json_type is None:
                raise ProtocolError(
                    f"tool {tool_name!r}: parameter {pname!r} needs one of the annotations "
                    f"{[t.__name__ for t in _JSON_TYPES]}"
                )
            properties[pname] = {"type": json_type}
            if param.default is param.empty:
                required.append(pname)
        doc = inspect.getdoc(fn) or ""
        desc = description if description is not None else doc.split("\n\n")[0].replace("\n", " ")
        params = {"type": "object", "properties": properties, "required": required}
        return Tool(ToolSpec(tool_name, desc, params), fn)


def _argument_problem(spec: ToolSpec, arguments: Mapping[str, Any]) -> str | None:
    props: Mapping[str, Any] = spec.parameters.get("properties", {})
    missing = [p for p in spec.parameters.get("required", ()) if p not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        return f"unexpected argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        want = props[key].get("type") if isinstance(props[key], Mapping) else None
        if want in _CHECKED_TYPES and not _matches(value, want):
            return f"argument {key!r} must be of type {want}, got {json.dumps(value)}"
    return None


def execute_tool_call(tools: Mapping[str, Tool], call: ToolCall) -> Message:
    """Run one call; every failure is returned as an `Error: ...` tool message, never raised."""

    def reply(text: str) -> Message:
        return Message("tool", text, tool_call_id=call.id, name=call.name)

    tool = tools.get(call.name)
    if tool is None:
        return reply(
            f"Error: unknown tool {call.name!r}. Available tools: {', '.join(sorted(tools)) or 'none'}."
        )
    problem = _argument_problem(tool.spec, call.arguments)
    if problem is not None:
        return reply(f"Error: bad arguments for {call.name!r}: {problem}.")
    try:
        result = tool.fn(**call.arguments)
    except (Exception, SystemExit) as exc:
        return reply(f"Error: tool {call.name!r} raised {type(exc).__name__}: {_safe_str(exc)}")
    return reply(render_result(result))


def _safe_str(value: object) -> str:
    try:
        return str(value)
    except Exception as exc:
        return f"<{type(value).__name__} whose str() raised {type(exc).__name__}>"


def render_result(result: object) -> str:
    """A tool's return value as observation text: strings as they are, JSON when it serializes, else `str()`.

    `Decimal`, `mpmath.mpf`, sets and other values JSON cannot hold are shown with `str()`, so a tool's
    return type never crashes an episode:

        >>> from decimal import Decimal
        >>> render_result("ok"), render_result({"a": [1, 2]}), render_result(Decimal("1.50"))
        ('ok', '{"a": [1, 2]}', '1.50')
    """
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        return str(result)
    except Exception as exc:
        return f"Error: the tool returned a {type(result).__name__} whose str() raised {type(exc).__name__}"


class ToolEnv(Environment):
    """An environment whose tools are Python functions and whose episode ends at the first turn
    without tool calls (the final answer).

    Subclasses implement `reset`, `tools` and usually `rubrics`/`state`; override `answer` to react to a
    final answer differently (for example to give feedback and continue).

    Example (README.md, "Environments", has the same environment with its rubric and registration):
        >>> import random
        >>> from envs.protocol import Message, ToolCall
        >>> class EchoEnv(ToolEnv):
        ...     def reset(self, seed: int):
        ...         self.word = random.Random(seed).choice(["apple", "river", "cloud"])
        ...         return (Message("user", f"Repeat this word exactly: {self.word}"),)
        ...     def shout(self, text: str) -> str:
        ...         '''Return the text in capital letters.'''
        ...         return text.upper()
        ...     def tools(self):
        ...         return (Tool.from_function(self.shout),)
        ...     def state(self):
        ...         return self.word
        >>> env = EchoEnv()
        >>> env.reset(0)[0].content.startswith("Repeat this word exactly: ")
        True
        >>> call = ToolCall("c0", "shout", {"text": "hi"})
        >>> env.step(Message("assistant", "", tool_calls=(call,))).messages[0].content
        'HI'
        >>> env.step(Message("assistant", env.word)).done
        True
    """

    @abstractmethod
    def tools(self) -> Sequence[Tool]:
        """The tools of the current task (usually bound methods wrapped by `Tool.from_function`)."""

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        return tuple(t.spec for t in self.tools())

    def step(self, message: Message) -> StepResult:
        if not message.tool_calls:
            return self.answer(message)
        table = {t.spec.name: t for t in self.tools()}
        return StepResult(tuple(execute_tool_call(table, c) for c in message.tool_calls))

    def answer(self, message: Message) -> StepResult:
        """Handle an assistant turn without tool calls. By default it ends the episode."""
        del message
        return StepResult(done=True)
