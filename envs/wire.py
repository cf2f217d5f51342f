"""What travels between the trainer and an environment worker: JSON text, bounded, rebuilt into typed values.

Both ends are treetrain's own code, but the worker runs the user's environment, so nothing it sends is
trusted: a reply is read with a byte limit (`MAX_REPLY_BYTES`), decoded as JSON (never unpickled), and
every value is rebuilt through the protocol's own validating constructors (`Message`, `StepResult`,
`ToolSpec`) with its counts bounded. A reply that breaks any of this is the environment's failure, not
the trainer's.

Example:
    >>> from envs.protocol import Message, ToolCall
    >>> m = Message("assistant", "hi", (ToolCall("c0", "add", {"a": 1}),))
    >>> message_from_wire(message_to_wire(m)) == m
    True
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from envs.protocol import Message, ProtocolError, StepResult, ToolCall, ToolSpec

MAX_REPLY_BYTES = 64 << 20
"""Largest reply a worker may send (64 MiB); tool results are cut far below this by the wrapper, so only a
runaway environment reaches it, and its episode fails instead of the trainer's memory."""
MAX_ITEMS = 4096
"""Most messages, tool calls, tools or rubrics in one reply."""
MAX_NAME_CHARS = 1024
"""Longest rubric name, method name or exception summary accepted from a worker."""
MAX_TRACEBACK_CHARS = 1 << 18
"""Longest traceback kept from a worker (its last 256 Ki characters: the innermost frames)."""


class WireError(ValueError):
    """A worker's reply that is not what the protocol allows; the message says what was wrong."""


def dumps(obj: object) -> bytes:
    """`obj` as compact JSON bytes (lone surrogates survive: JSON escapes them)."""
    return json.dumps(obj, separators=(",", ":"), default=repr).encode("utf-8")


def loads(data: bytes) -> Any:
    """Decoded JSON; anything else is a `WireError`."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"a reply that is not JSON ({type(exc).__name__})") from None


def message_to_wire(message: Message) -> dict[str, Any]:
    return {
        "role": message.role,
        "content": message.content,
        "tool_calls": [[c.id, c.name, dict(c.arguments)] for c in message.tool_calls],
        "tool_call_id": message.tool_call_id,
        "name": message.name,
    }


def _items(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise WireError(f"{what}: expected a list, got {type(value).__name__}")
    if len(value) > MAX_ITEMS:
        raise WireError(f"{what}: {len(value)} items, more than {MAX_ITEMS}")
    return value


def _str(value: object, what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise WireError(f"{what}: expected a string, got {type(value).__name__}")
    return value


def message_from_wire(obj: object) -> Message:
    if not isinstance(obj, dict):
        raise WireError(f"a message must be an object, got {type(obj).__name__}")
    calls = []
    for call in _items(obj.get("tool_calls", []), "tool_calls"):
        if not (isinstance(call, list) and len(call) == 3 and isinstance(call[2], dict)):
            raise WireError("a tool call must be [id, name, arguments]")
        calls.append(ToolCall(_str(call[0], "tool call id"), _str(call[1], "tool call name"), call[2]))
    try:
        return Message(
            _str(obj.get("role"), "role"),
            _str(obj.get("content"), "content"),
            tuple(calls),
            _str(obj.get("tool_call_id"), "tool_call_id", optional=True),
            _str(obj.get("name"), "name", optional=True),
        )
    except ProtocolError as exc:
        raise WireError(str(exc)) from None


def messages_to_wire(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [message_to_wire(m) for m in messages]


def messages_from_wire(obj: object, what: str = "messages") -> tuple[Message, ...]:
    return tuple(message_from_wire(m) for m in _items(obj, what))


def result_to_wire(result: StepResult) -> dict[str, Any]:
    info = {str(k): v if isinstance(v, str | int | float | bool) else repr(v) for k, v in result.info.items()}
    return {"messages": messages_to_wire(result.messages), "done": bool(result.done), "info": info}


def result_from_wire(obj: object) -> StepResult:
    if not isinstance(obj, dict) or not isinstance(obj.get("done"), bool):
        raise WireError("a step result must be an object with a boolean 'done'")
    info = obj.get("info", {})
    if not isinstance(info, dict) or len(info) > MAX_ITEMS:
        raise WireError(f"step info must be an object of at most {MAX_ITEMS} entries")
    clean = {k: v for k, v in info.items() if isinstance(v, str | int | float | bool)}
    try:
        return StepResult(messages_from_wire(obj.get("messages")), obj["done"], clean)
    except ProtocolError as exc:
        raise WireError(str(exc)) from None


def tools_to_wire(tools: Sequence[ToolSpec]) -> list[list[Any]]:
    return [[t.name, t.description, json.loads(json.dumps(dict(t.parameters)))] for t in tools]


def tools_from_wire(obj: object) -> tuple[ToolSpec, ...]:
    out = []
    for item in _items(obj, "tool specs"):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], Mapping)):
            raise WireError("a tool spec must be [name, description, parameters]")
        try:
            out.append(ToolSpec(_str(item[0], "tool name"), _str(item[1], "tool description"), item[2]))
        except ProtocolError as exc:
            raise WireError(str(exc)) from None
    return tuple(out)


def names_from_wire(obj: object, what: str) -> tuple[str, ...]:
    names = tuple(_str(n, what) for n in _items(obj, what))
    if any(len(n) > MAX_NAME_CHARS for n in names):
        raise WireError(f"{what}: a name longer than {MAX_NAME_CHARS} characters")
    return names
