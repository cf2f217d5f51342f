"""The one tool-call text format, and its conversion to OpenAI-style `ToolCall`s.

A model calls a tool by writing, anywhere in its turn, a JSON object inside `<tool_call>` tags (the
Qwen/Hermes convention, and what the shipped chat template renders):

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "17 * 23"}}
    </tool_call>

`arguments` must be a JSON object; a JSON *string* holding an object (the OpenAI wire form) is accepted
too. Several calls in one turn are allowed. The text outside the well-formed calls is the message content:
a malformed call stays in it, so a rubric can still see (and score) the attempt.

Parsing never raises on model output: every malformed call becomes a `ToolCallError`, which the wrapper
turns into a `tool` observation so the agent can see and fix its mistake. Call ids are deterministic
(`call_<turn>_<index>`), so re-running a rollout gives identical messages.

Example:
    >>> turn = parse_tool_calls('Let me check.\\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', turn=0)
    >>> turn.message.content, turn.message.tool_calls[0].name, dict(turn.message.tool_calls[0].arguments)
    ('Let me check.', 'f', {'x': 1})
    >>> parse_tool_calls("<tool_call>{oops}</tool_call>", turn=1).errors[0].call_id
    'call_1_0'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from envs.protocol import Message, ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


def closed_end(text: str) -> int:
    """Where the last CLOSE_TAG in `text` ends (0 when there is none): the end of the part a call pattern
    that ends with CLOSE_TAG can match. Matching only there gives the same matches, and an opener after
    it is never scanned to the end of the text for a CLOSE_TAG that is not there (once per opener:
    quadratic in a degenerate turn that repeats an opener)."""
    at = text.rfind(CLOSE_TAG)
    return at + len(CLOSE_TAG) if at >= 0 else 0


@dataclass(frozen=True)
class ToolCallError:
    """A tool call the model wrote but that could not be parsed."""

    call_id: str
    problem: str
    text: str
    hint: str = ""
    """How a well-formed call looks in this format (empty: the Hermes form)."""

    def to_message(self) -> Message:
        """The observation the agent sees instead of a tool result."""
        return Message(
            "tool",
            f"Error: malformed tool call ({self.problem}). {self.hint or FORMAT_HINT}",
            tool_call_id=self.call_id,
        )


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn: the message with its well-formed calls, plus the malformed ones."""

    message: Message
    errors: tuple[ToolCallError, ...]


FORMAT_HINT = 'Write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>.'


def _parse_one(body: str, call_id: str) -> ToolCall | ToolCallError:
    try:
        obj: Any = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(call_id, f"invalid JSON: {exc.msg} at char {exc.pos}", body)
    return call_from_object(obj, call_id)


def call_from_object(
    obj: Any, call_id: str, args_keys: tuple[str, ...] = ("arguments",), hint: str = ""
) -> ToolCall | ToolCallError:
    """A decoded `{"name": ..., "<args key>": {...}}` object as a `ToolCall`, or what is wrong with it.

    The arguments may also be a JSON string holding an object (the OpenAI wire form)."""
    body = json.dumps(obj, default=repr)
    if not isinstance(obj, dict):
        return ToolCallError(call_id, f"expected a JSON object, got {type(obj).__name__}", body, hint)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(call_id, "missing or empty 'name'", body, hint)
    key = next((k for k in args_keys if k in obj), args_keys[0])
    args: Any = obj.get(key, {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(call_id, f"{key!r} string is not JSON: {exc.msg}", body, hint)
    if not isinstance(args, dict):
        return ToolCallError(call_id, f"{key!r} must be a JSON object, got {type(args).__name__}", body, hint)
    extra = sorted(set(obj) - {"name", key})
    if extra:
        return ToolCallError(call_id, f"unexpected keys {extra}", body, hint)
    return ToolCall(call_id, name, args)


def parse_tool_calls(text: str, turn: int) -> ParsedTurn:
    """Split an assistant turn's text into content, tool calls and malformed calls.

    `turn` numbers the assistant turns of the episode; it only feeds the call ids.
    """
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    pieces: list[str] = []
    pos = 0
    index = 0
    for m in _CALL_RE.finditer(text, 0, closed_end(text)):
        pieces.append(text[pos : m.start()])
        pos = m.end()
        parsed = _parse_one(m.group(1).strip(), f"call_{turn}_{index}")
        index += 1
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(parsed)
            pieces.append(m.group(0))  # a malformed call stays in the content, for rubrics to see
    rest = text[pos:]
    dangling = rest.find(OPEN_TAG)
    if dangling >= 0:
        errors.append(
            ToolCallError(f"call_{turn}_{index}", f"{OPEN_TAG} without {CLOSE_TAG}", rest[dangling:])
        )
    elif CLOSE_TAG in rest:
        errors.append(ToolCallError(f"call_{turn}_{index}", f"{CLOSE_TAG} without {OPEN_TAG}", rest))
    pieces.append(rest)
    content = "".join(pieces).strip()
    return ParsedTurn(Message("assistant", content, tuple(calls)), tuple(errors))


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text a model writes to call `name`: the inverse of `parse_tool_calls` (used by tests and demos)."""
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE_TAG}"
