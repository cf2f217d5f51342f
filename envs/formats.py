"""Tool-call formats: how a model family writes tool calls in its turn, as a small registry.

Each format parses an assistant turn's text into content, OpenAI-style `ToolCall`s and malformed calls,
and writes a call the way the model would (for tests and scripted policies). The chat template renders
calls itself; a format only says how to read them back. Parsing never raises on model output: a
malformed call becomes a `ToolCallError`, which the wrapper shows to the agent as an `Error: ...` tool
message. A format is chosen by name (`env.tool_format`) or detected from the chat template's text.

| name | model families | a call looks like |
|---|---|---|
| `hermes` | Qwen 2/2.5/3, Hermes, the shipped tokenizer | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` |
| `glm45` | GLM-4.5 / 4.6 / 4.7 / 5 | `<tool_call>NAME\\n<arg_key>ARG</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>` |
| `qwen3_coder` | Qwen3-Coder, Qwen3.5, Qwen3.6 | `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>` |
| `llama3` | Llama 3.1 / 3.2 / 3.3 (JSON tool calling) | `<|python_tag|>{"name": ..., "parameters": {...}}` (the tag optional) |
| `mistral` | Mistral / Mixtral v0.3 tokenizers | `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}]` |
| `deepseek_v3` | DeepSeek V3 / R1 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a json block |

Example:
    >>> fmt = FORMATS["llama3"]
    >>> turn = fmt.parse('{"name": "add", "parameters": {"a": 1, "b": 2}}', turn=0)
    >>> turn.message.tool_calls[0].name, dict(turn.message.tool_calls[0].arguments)
    ('add', {'a': 1, 'b': 2})
    >>> detect_format("... [TOOL_CALLS] ...").name
    'mistral'
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envs.protocol import Message, ToolCall, ToolSpec
from envs.toolcalls import (
    CLOSE_TAG,
    OPEN_TAG,
    ParsedTurn,
    ToolCallError,
    call_from_object,
    closed_end,
    parse_tool_calls,
)
from treetrain.errors import TreetrainError


@dataclass(frozen=True)
class ToolCallFormat:
    """One model family's tool-call syntax."""

    name: str
    parse: Callable[[str, int], ParsedTurn]
    """`parse(text, turn)`: the turn's content, well-formed calls and malformed ones."""
    write: Callable[[str, Mapping[str, Any], str], str]
    """`write(name, arguments, call_id)`: the text a model writes to make that call."""
    markers: tuple[str, ...]
    """Substrings of a chat template that identify this format."""
    arguments_as_string: bool = False
    """The chat template expects `function.arguments` as a JSON string (it concatenates it), not an object."""

    typed_by_schema: bool = False
    """Argument values are written as bare text (`<parameter=x>\n42\n</parameter>`), so their JSON type
    comes from the tool's schema: `read` keeps a string parameter's text as it is and decodes the rest."""

    def read(self, text: str, turn: int, tools: Sequence[ToolSpec] = ()) -> ParsedTurn:
        """`parse`, guarded: whatever the model wrote, a failure of the JSON decoder itself (an integer
        past Python's digit limit, nesting past the recursion limit) is one more malformed call, never an
        exception out of the episode.

        >>> FORMATS["mistral"].read("[TOOL_CALLS] " + "[" * 100_000, turn=0).errors[0].problem
        'unparseable tool call (RecursionError)'
        """
        try:
            reasoning, rest = _split_reasoning(text)
            parsed = self.parse(rest, turn)
            if reasoning:
                gap = rest[: len(rest) - len(rest.lstrip())] if parsed.message.content else ""
                content = (reasoning + gap + parsed.message.content).strip()
                parsed = ParsedTurn(Message("assistant", content, parsed.message.tool_calls), parsed.errors)
            return _typed(parsed, {t.name: t for t in tools}) if self.typed_by_schema else parsed
        except (ValueError, RecursionError, TypeError, OverflowError) as exc:
            err = ToolCallError(
                f"call_{turn}_0", f"unparseable tool call ({type(exc).__name__})", text[:1000]
            )
            return ParsedTurn(Message("assistant", text.strip()), (err,))


def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest): a turn's `<think>...</think>` block and the text after it. Calls are read from
    the rest only: a call a model writes while reasoning is a draft, not a call. A block never closed (a
    turn cut by its budget) is all reasoning.

    >>> _split_reasoning("<think>try <tool_call>x</tool_call>?</think> ok")
    ('<think>try <tool_call>x</tool_call>?</think>', ' ok')
    """
    close = text.find(_THINK_CLOSE)
    if close >= 0:
        return text[: close + len(_THINK_CLOSE)], text[close + len(_THINK_CLOSE) :]
    start = text.find(_THINK_OPEN)
    if start >= 0 and not text[:start].strip():
        return text, ""
    return "", text


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def _llama3_parse(text: str, turn: int) -> ParsedTurn:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        if tagged:
            err = ToolCallError(
                f"call_{turn}_0", "<|python_tag|> not followed by a JSON object", text, LLAMA3_HINT
            )
            return ParsedTurn(Message("assistant", text.strip()), (err,))
        return ParsedTurn(Message("assistant", text.strip()), ())
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    decoder = json.JSONDecoder()
    pos, index = 0, 0
    while pos < len(body):
        call_id = f"call_{turn}_{index}"
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            errors.append(
                ToolCallError(call_id, f"invalid JSON: {exc.msg} at char {exc.pos}", body[pos:], LLAMA3_HINT)
            )
            break
        parsed = call_from_object(obj, call_id, args_keys=("parameters", "arguments"), hint=LLAMA3_HINT)
        if isinstance(parsed, ToolCall) and calls:  # Llama 3.1 templates render one call per turn
            parsed = ToolCallError(
                call_id, "one tool call per turn in this format", body[pos:end], LLAMA3_HINT
            )
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)  # type: ignore[arg-type]
        index += 1
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    content = "" if calls and not errors else text.strip()
    return ParsedTurn(Message("assistant", content, tuple(calls)), tuple(errors))


LLAMA3_HINT = 'Reply with only {"name": "<tool>", "parameters": {...}}.'
MISTRAL_HINT = 'Write [TOOL_CALLS] [{"name": "<tool>", "arguments": {...}}].'
DEEPSEEK_HINT = (
    "Write <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><tool>\\n```json\\n{...}\\n```"
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>."
)


def _mistral_id(turn: int, index: int) -> str:
    """Mistral templates require call ids of exactly 9 alphanumerics."""
    return f"c{turn % 10000:04d}{index % 10000:04d}"


def _mistral_parse(text: str, turn: int) -> ParsedTurn:
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return ParsedTurn(Message("assistant", text.strip()), ())
    call_id = _mistral_id(turn, 0)
    try:
        obj, end = json.JSONDecoder().raw_decode(tail.strip())
    except json.JSONDecodeError as exc:
        err = ToolCallError(
            call_id, f"invalid JSON after [TOOL_CALLS]: {exc.msg} at char {exc.pos}", tail, MISTRAL_HINT
        )
        return ParsedTurn(Message("assistant", text.strip()), (err,))
    items = obj if isinstance(obj, list) else [obj]
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            item = {k: v for k, v in item.items() if k != "id"}
        parsed = call_from_object(item, _mistral_id(turn, i), hint=MISTRAL_HINT)
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)  # type: ignore[arg-type]
    if tail.strip()[end:].strip():
        errors.append(
            ToolCallError(_mistral_id(turn, len(items)), "text after the call list", tail, MISTRAL_HINT)
        )
    content = head.strip() if not errors else text.strip()
    return ParsedTurn(Message("assistant", content, tuple(calls)), tuple(errors))


def _mistral_write(name: str, arguments: Mapping[str, Any], call_id: str) -> str:
    return "[TOOL_CALLS] " + json.dumps([{"name": name, "arguments": dict(arguments), "id": call_id}])


_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:(?P<type>\w+)<｜tool▁sep｜>(?P<name>[^\n<]+)\n```json\n(?P<args>.*?)\n```"
    r"|(?P<name31>[^<]+?)<｜tool▁sep｜>(?P<args31>.*?))<｜tool▁call▁end｜>",
    re.DOTALL,
)


def _deepseek_parse(text: str, turn: int) -> ParsedTurn:
    start = text.find(_DS_BEGIN)
    if start < 0:
        return ParsedTurn(Message("assistant", text.strip()), ())
    block = text[start + len(_DS_BEGIN) :]
    stop = block.find(_DS_END)
    errors: list[ToolCallError] = []
    if stop < 0:
        errors.append(ToolCallError(f"call_{turn}_0", f"{_DS_BEGIN} without {_DS_END}", block, DEEPSEEK_HINT))
    else:
        block = block[:stop]
    calls: list[ToolCall] = []
    for index, m in enumerate(_DS_CALL.finditer(block)):
        call_id = f"call_{turn}_{index}"
        name = (m.group("name") or m.group("name31") or "").strip()
        raw = m.group("args") if m.group("name") is not None else m.group("args31")
        try:
            args = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            errors.append(
                ToolCallError(
                    call_id, f"invalid JSON arguments: {exc.msg} at char {exc.pos}", raw, DEEPSEEK_HINT
                )
            )
            continue
        parsed = call_from_object({"name": name, "arguments": args}, call_id, hint=DEEPSEEK_HINT)
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)  # type: ignore[arg-type]
    if not calls and not errors:
        errors.append(
            ToolCallError(
                f"call_{turn}_0", "no well-formed call inside the tool-call block", block, DEEPSEEK_HINT
            )
        )
    content = text[:start].strip() if not errors else text.strip()
    return ParsedTurn(Message("assistant", content, tuple(calls)), tuple(errors))


def _deepseek_write(name: str, arguments: Mapping[str, Any], call_id: str) -> str:
    return (
        f"{_DS_BEGIN}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(dict(arguments))}\n```"
        f"<｜tool▁call▁end｜>{_DS_END}"
    )


_XML_CALL = re.compile(
    re.escape(OPEN_TAG) + r"\s*<function=([^>\n]+)>(.*?)</function>\s*" + re.escape(CLOSE_TAG), re.DOTALL
)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_LITERALS = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
XML_HINT = (
    "Write <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>."
)


def _xml_parse(text: str, turn: int) -> ParsedTurn:
    """Qwen3-Coder / Qwen3.5 calls; every value is kept as its text here (typed by `_typed`)."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    pieces: list[str] = []
    pos = 0
    for index, m in enumerate(_XML_CALL.finditer(text, 0, closed_end(text))):
        pieces.append(text[pos : m.start()])
        pos = m.end()
        call_id = f"call_{turn}_{index}"
        body = m.group(2)
        args = {k.strip(): v for k, v in _XML_PARAM.findall(body)}
        if _XML_PARAM.sub("", body).strip():
            errors.append(ToolCallError(call_id, "text outside <parameter=...> tags", m.group(0), XML_HINT))
            pieces.append(m.group(0))
        else:
            calls.append(ToolCall(call_id, m.group(1).strip(), args))
    rest = text[pos:]
    if OPEN_TAG in rest or CLOSE_TAG in rest:
        errors.append(
            ToolCallError(
                f"call_{turn}_{len(calls) + len(errors)}", "unclosed or malformed <tool_call>", rest, XML_HINT
            )
        )
    pieces.append(rest)
    content = "".join(pieces).strip()
    return ParsedTurn(Message("assistant", content, tuple(calls)), tuple(errors))


# The name is taken whole (`(?=(X))\1`: an atomic group that Python 3.10 can write): a CLOSE_TAG cannot
# start inside it, so the matches are the same, but a name line without CLOSE_TAG is scanned once, not once
# per character of the name (quadratic in a degenerate turn's length).
_GLM_CALL = re.compile(re.escape(OPEN_TAG) + r"(?=([^\n<]+))\1(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
GLM_HINT = "Write <tool_call>NAME\n<arg_key>ARG</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>."


def _glm_parse(text: str, turn: int) -> ParsedTurn:
    """GLM-4.5 and later; every value is kept as its text here (typed by `_typed`)."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    pieces: list[str] = []
    pos = 0
    for index, m in enumerate(_GLM_CALL.finditer(text, 0, closed_end(text))):
        pieces.append(text[pos : m.start()])
        pos = m.end()
        call_id = f"call_{turn}_{index}"
        body = m.group(2)
        if _GLM_ARG.sub("", body).strip():
            errors.append(
                ToolCallError(call_id, "text outside <arg_key>/<arg_value> pairs", m.group(0), GLM_HINT)
            )
            pieces.append(m.group(0))
            continue
        calls.append(ToolCall(call_id, m.group(1).strip(), {k.strip(): v for k, v in _GLM_ARG.findall(body)}))
    rest = text[pos:]
    if OPEN_TAG in rest or CLOSE_TAG in rest:
        index = len(calls) + len(errors)
        errors.append(
            ToolCallError(f"call_{turn}_{index}", "unclosed or malformed <tool_call>", rest, GLM_HINT)
        )
    pieces.append(rest)
    return ParsedTurn(Message("assistant", "".join(pieces).strip(), tuple(calls)), tuple(errors))


def _glm_write(name: str, arguments: Mapping[str, Any], call_id: str) -> str:
    args = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
        for k, v in arguments.items()
    )
    return f"{OPEN_TAG}{name}\n{args}{CLOSE_TAG}"


def _bare_value(text: str, schema: Any) -> Any:
    """A parameter's bare text as JSON: a string parameter keeps it, anything else is decoded (JSON, or
    the Python literals `True`/`False`/`None` that the template's `| string` writes), else left as text."""
    kinds = _kinds(schema)
    if "null" in kinds and text.strip() in ("None", "null"):
        return None
    if "string" in kinds:
        return text
    if text.strip() in _LITERALS:
        return _LITERALS[text.strip()]
    try:
        return json.loads(text)
    except ValueError:
        return text


def _kinds(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows, through `anyOf`/`oneOf` (`Optional[str]` is an anyOf)."""
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    kinds = (
        {kind}
        if isinstance(kind, str)
        else {k for k in kind if isinstance(k, str)}
        if isinstance(kind, list)
        else set()
    )
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            kinds |= _kinds(sub)
    return kinds


def _typed(parsed: ParsedTurn, tools: Mapping[str, ToolSpec]) -> ParsedTurn:
    calls = []
    for call in parsed.message.tool_calls:
        spec = tools.get(call.name)
        props = (spec.parameters.get("properties") or {}) if spec is not None else {}
        args = {
            k: _bare_value(v, props.get(k)) if isinstance(v, str) else v for k, v in call.arguments.items()
        }
        calls.append(ToolCall(call.id, call.name, args))
    message = Message("assistant", parsed.message.content, tuple(calls))
    return ParsedTurn(message, parsed.errors)


def _xml_write(name: str, arguments: Mapping[str, Any], call_id: str) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in arguments.items()
    )
    return f"{OPEN_TAG}\n<function={name}>\n{params}</function>\n{CLOSE_TAG}"


def _hermes_write(name: str, arguments: Mapping[str, Any], call_id: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n</tool_call>"


def _llama3_write(name: str, arguments: Mapping[str, Any], call_id: str) -> str:
    return json.dumps({"name": name, "parameters": dict(arguments)})


FORMATS: Mapping[str, ToolCallFormat] = {
    # detection tries these in order: qwen3_coder's markers also contain hermes's <tool_call>
    "qwen3_coder": ToolCallFormat(
        "qwen3_coder", _xml_parse, _xml_write, ("<function=",), typed_by_schema=True
    ),
    "glm45": ToolCallFormat("glm45", _glm_parse, _glm_write, ("<arg_key>",), typed_by_schema=True),
    "hermes": ToolCallFormat("hermes", parse_tool_calls, _hermes_write, ("<tool_call>",)),
    "mistral": ToolCallFormat("mistral", _mistral_parse, _mistral_write, ("[TOOL_CALLS]",)),
    "deepseek_v3": ToolCallFormat(
        "deepseek_v3", _deepseek_parse, _deepseek_write, ("tool▁calls▁begin",), arguments_as_string=True
    ),
    "llama3": ToolCallFormat("llama3", _llama3_parse, _llama3_write, ("<|python_tag|>", '"parameters": ')),
}


class UnknownFormatError(TreetrainError, ValueError):
    """No tool-call format has that name; the message lists the known ones."""


def get_format(name: str) -> ToolCallFormat:
    """The format called `name` (see `FORMATS`)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownFormatError(
            f"unknown tool-call format {name!r}; known: {sorted(FORMATS)} or 'auto'"
        ) from None


def detect_format(chat_template: str | None) -> ToolCallFormat:
    """The format whose markers appear in the template text; `hermes` when none does."""
    text = chat_template or ""
    for fmt in FORMATS.values():
        if any(marker in text for marker in fmt.markers):
            return fmt
    return FORMATS["hermes"]
