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

import asyncio
import functools
import inspect
import json
import re
import threading
import typing
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import docstring_parser

from envs.protocol import Environment, Message, ProtocolError, StepResult, ToolCall, ToolSpec
from envs.tool_schema import arguments_problem, from_json, schema_for


class StepAbandoned(BaseException):
    """Raised inside a step thread that ran past its timeout, so a tool stuck in a Python loop stops
    instead of spinning for the rest of the run (a BaseException: a tool's `except Exception` cannot
    swallow it). A blocking call (sleep, I/O) ends when it returns."""


@dataclass(frozen=True)
class Tool:
    """A callable tool and the spec shown to the model. The spec's JSON Schema is checked when the tool
    is built (`ToolSpec` refuses non-standard type names, naming the field) and enforced on every call."""

    spec: ToolSpec
    fn: Callable[..., object]

    @staticmethod
    def from_function(
        fn: Callable[..., object], name: str | None = None, description: str | None = None
    ) -> Tool:
        """Build a tool from a typed function: annotations become JSON Schema (`envs.tool_schema.schema_for`),
        defaults make a parameter optional, and a Google- or NumPy-style docstring gives the tool's and each
        parameter's description."""
        target = _annotated(fn)
        tool_name = name or str(getattr(target, "__name__", "") or type(fn).__name__)
        if tool_name == "__call__":
            tool_name = type(fn).__name__
        try:
            hints = typing.get_type_hints(target, include_extras=True)
        except (
            Exception
        ) as exc:  # a NameError from an unresolvable forward reference, or no annotations at all
            raise ProtocolError(f"tool {tool_name!r}: cannot read its annotations ({exc})") from None
        doc = inspect.getdoc(target) or ""
        param_docs = {p.arg_name: p.description for p in docstring_parser.parse(doc).params if p.description}
        properties: dict[str, dict[str, Any]] = {}
        required: list[str] = []
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ProtocolError(f"tool {tool_name!r}: *args/**kwargs cannot be described to the model")
            if pname not in hints:
                raise ProtocolError(f"tool {tool_name!r}: parameter {pname!r} needs a type annotation")
            try:
                prop = schema_for(hints[pname], f"tool {tool_name!r}: parameter {pname!r}")
            except TypeError as exc:
                raise ProtocolError(str(exc)) from None
            except RecursionError:
                raise ProtocolError(
                    f"tool {tool_name!r}: parameter {pname!r}: a recursive type has no finite JSON Schema"
                ) from None
            if pname in param_docs:
                prop["description"] = " ".join(param_docs[pname].split())
            if param.default is param.empty:
                required.append(pname)
            elif _is_json(
                default := param.default.value if isinstance(param.default, Enum) else param.default
            ):
                prop["default"] = default  # an Enum member's default shows its value
            properties[pname] = prop
        if description is None:
            description = doc.split("\n\n")[0].replace("\n", " ")
            if _SECTION.match(description):
                description = ""
        params = {"type": "object", "properties": properties, "required": required}
        return Tool(ToolSpec(tool_name, description, params), _converting(fn, hints))

    @staticmethod
    def from_openai(entry: Mapping[str, Any], fn: Callable[..., object]) -> Tool:
        """A tool from one OpenAI `tools` entry (`{"type": "function", "function": {...}}`, or the bare
        `{"name", "description", "parameters"}`), called as `fn(**arguments)`."""
        spec = entry.get("function", entry) if entry.get("type", "function") == "function" else None
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise ProtocolError(f"tools entry {json.dumps(entry, default=repr)[:200]} has no function name")
        parameters = spec.get("parameters", {"type": "object", "properties": {}})
        return Tool(ToolSpec(spec["name"], str(spec.get("description", "")), parameters), fn)


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Raises)\s*:?\s*(-+)?\s", re.IGNORECASE)


def _annotated(fn: Callable[..., object]) -> Callable[..., object]:
    """The function whose annotations and docstring describe `fn`: through `functools.partial`, and a
    callable object's `__call__` (`inspect.signature(fn)` already drops bound and partial arguments)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn) or not callable(fn):
        return fn
    return type(fn).__call__  # type: ignore[operator]


def _converting(fn: Callable[..., object], hints: Mapping[str, Any]) -> Callable[..., object]:
    """`fn`, called with its JSON arguments turned into the annotated Python types (an `Enum` member, a
    dataclass, a set, a tuple) where the annotation asks for one; plain JSON types pass unchanged."""

    def call(**arguments: Any) -> object:
        return fn(**{k: from_json(hints[k], v) if k in hints else v for k, v in arguments.items()})

    call.__name__ = str(getattr(fn, "__name__", "tool"))
    call.__doc__ = fn.__doc__
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def _is_json(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def tools_from_openai(
    tools: Sequence[Mapping[str, Any]], dispatch: Callable[[str, dict[str, Any]], object]
) -> tuple[Tool, ...]:
    """Tools from an OpenAI-style `tools` list and one dispatch function `dispatch(name, arguments)`.

    Every schema is checked here (a non-standard type such as `"dict"` or `"float"` is refused, naming the
    tool and field); at call time the arguments are validated before `dispatch` sees them.

        >>> TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add numbers.",
        ...     "parameters": {"type": "object", "properties": {"xs": {"type": "array",
        ...     "items": {"type": "number"}}}, "required": ["xs"]}}}]
        >>> table = {t.spec.name: t for t in tools_from_openai(TOOLS, lambda name, args: sum(args["xs"]))}
        >>> execute_tool_call(table, ToolCall("c0", "add", {"xs": [1, 2.5]})).content
        '3.5'
        >>> execute_tool_call(table, ToolCall("c1", "add", {"xs": [1, "2"]})).content
        "Error: bad arguments for 'add': argument 'xs'[1]: '2' is not of type 'number'."
    """
    return tuple(Tool.from_openai(e, _bind(dispatch, str(e.get("function", e).get("name")))) for e in tools)


def _bind(dispatch: Callable[[str, dict[str, Any]], object], name: str) -> Callable[..., object]:
    def call(**arguments: Any) -> object:
        return dispatch(name, arguments)

    return call


def execute_tool_call(tools: Mapping[str, Tool], call: ToolCall) -> Message:
    """Run one call; every failure is returned as an `Error: ...` tool message, never raised."""

    def reply(text: str) -> Message:
        return Message("tool", text, tool_call_id=call.id, name=call.name)

    tool = tools.get(call.name)
    if tool is None:
        return reply(
            f"Error: unknown tool {call.name!r}. Available tools: {', '.join(sorted(tools)) or 'none'}."
        )
    problem = arguments_problem(tool.spec.parameters, call.arguments)
    if problem is not None:
        return reply(f"Error: bad arguments for {call.name!r}: {problem}.")
    try:
        result = tool.fn(**call.arguments)
        if inspect.isawaitable(result):  # an `async def` tool: run it to completion on its own event loop
            result = asyncio.run(_awaited(result))
    except StepAbandoned:
        raise
    except KeyboardInterrupt:
        if threading.current_thread() is threading.main_thread():
            raise  # a real Ctrl-C stops the run; in a step thread it can only come from the tool itself
        return reply(f"Error: tool {call.name!r} raised KeyboardInterrupt")
    except BaseException as exc:  # SystemExit, GeneratorExit and anything else tool code raises
        return reply(f"Error: tool {call.name!r} raised {type(exc).__name__}: {_safe_str(exc)}")
    return reply(render_result(result))


async def _awaited(awaitable: Any) -> object:
    return await awaitable


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
