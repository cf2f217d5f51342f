"""Tool code and tool typing as real tool libraries write them: what the checker found, each a test.

Hostile tools that raise `BaseException`s other than `Exception` inside a step thread, and results that
cannot be tokenized, become tool messages; schemas that would need the network are refused when built;
`Tool.from_function` takes `Enum`, dataclass, `TypedDict` and `set` parameters and hands the tool those
types; bare-text argument values (Qwen3-Coder / Qwen3.5 calls) are typed by the tool's schema.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import sys
from collections.abc import Sequence
from typing import TypedDict

import pytest
from support.env_fixtures import tokenizer

from envs import Message, ProtocolError, Tool, ToolCall, ToolEnv, tools_from_openai
from envs.formats import FORMATS
from envs.tools import execute_tool_call
from envs.wrapper import EpisodeLimits, TokenEnv, WrapperConfig


def interrupt() -> str:
    """Raises KeyboardInterrupt."""
    raise KeyboardInterrupt


def generator_exit() -> str:
    """Raises GeneratorExit."""
    raise GeneratorExit("closed")


def exits() -> str:
    """Calls sys.exit."""
    sys.exit(3)


def lone_surrogate() -> str:
    """Returns a str no tokenizer can encode."""
    return "caf\ud800e"


class Hostile(ToolEnv):
    def reset(self, seed: int) -> Sequence[Message]:
        return (Message("user", "go"),)

    def tools(self) -> Sequence[Tool]:
        return tuple(Tool.from_function(f) for f in (interrupt, generator_exit, exits, lone_surrogate))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("interrupt", "Error: tool 'interrupt' raised KeyboardInterrupt"),
        ("generator_exit", "Error: tool 'generator_exit' raised GeneratorExit: closed"),
        ("exits", "Error: tool 'exits' raised SystemExit: 3"),
        ("lone_surrogate", "caf\ufffde"),
    ],
)
def test_a_hostile_tool_in_a_step_thread_is_a_tool_message(name: str, expected: str) -> None:
    env = TokenEnv(Hostile(), tokenizer(), WrapperConfig(EpisodeLimits(step_timeout_s=5.0)))
    env.reset(0)
    turn = env.template.encode(env.template.write_call(name, {}) + env.template.end_of_turn)
    result = env.step(turn)
    assert not result.done and [m.content for m in result.messages] == [expected]
    assert env.template.decode(result.observation).count(expected) == 1


def test_a_keyboard_interrupt_in_the_main_thread_still_stops_the_run() -> None:
    """Without a step timeout the tool runs in the trainer's own thread, where Ctrl-C must stop the run."""
    table = {"interrupt": Tool.from_function(interrupt)}
    with pytest.raises(KeyboardInterrupt):
        execute_tool_call(table, ToolCall("c0", "interrupt", {}))


def test_a_remote_ref_is_refused_when_the_tool_is_built() -> None:
    params = {"type": "object", "properties": {"p": {"$ref": "https://example.com/person.json"}}}
    with pytest.raises(ProtocolError, match=r"parameters\.properties\.p\.\$ref: .* is not a local reference"):
        tools_from_openai([{"name": "t", "parameters": params}], lambda name, arguments: None)
    local = {
        "type": "object",
        "$defs": {"P": {"type": "integer"}},
        "properties": {"p": {"$ref": "#/$defs/P"}},
    }
    (tool,) = tools_from_openai([{"name": "t", "parameters": local}], lambda name, arguments: arguments["p"])
    assert execute_tool_call({"t": tool}, ToolCall("c0", "t", {"p": "x"})).content.endswith(
        "argument 'p': 'x' is not of type 'integer'."
    )


class Unit(enum.Enum):
    CELSIUS = "celsius"
    KELVIN = "kelvin"


@dataclasses.dataclass(frozen=True)
class Point:
    x: float
    y: float = 0.0


class Person(TypedDict):
    name: str
    age: int


def plan(
    start: Point,
    people: list[Person],
    tags: set[str],
    unit: Unit = Unit.CELSIUS,
    pair: tuple[int, str] | None = None,
) -> str:
    """Plan a trip.

    Args:
        start: Where to start.
        people: Who travels.
    """
    return repr((start, people, sorted(tags), unit, pair))


def test_from_function_takes_enums_dataclasses_typeddicts_and_sets() -> None:
    tool = Tool.from_function(plan)
    props = tool.spec.parameters["properties"]
    assert props["unit"] == {"type": "string", "enum": ["celsius", "kelvin"], "default": "celsius"}
    assert props["start"]["required"] == ["x"] and props["start"]["description"] == "Where to start."
    assert props["people"]["items"]["required"] == ["name", "age"]
    assert props["tags"] == {"type": "array", "uniqueItems": True, "items": {"type": "string"}}
    arguments = {
        "start": {"x": 1.5},
        "people": [{"name": "Ann", "age": 30}],
        "tags": ["b", "a"],
        "unit": "kelvin",
        "pair": [1, "a"],
    }
    content = execute_tool_call({"plan": tool}, ToolCall("c0", "plan", arguments)).content
    expected = (Point(1.5), [{"name": "Ann", "age": 30}], ["a", "b"], Unit.KELVIN, (1, "a"))
    assert content == repr(expected)
    bad = execute_tool_call({"plan": tool}, ToolCall("c1", "plan", {**arguments, "unit": "F"})).content
    assert bad == "Error: bad arguments for 'plan': argument 'unit': 'F' is not one of ['celsius', 'kelvin']."


@dataclasses.dataclass
class Node:
    value: int
    child: Node | None = None


def test_a_recursive_type_is_refused_with_the_parameter_named() -> None:
    def walk(node: Node) -> int:
        return node.value

    with pytest.raises(ProtocolError, match="parameter 'node': a recursive type has no finite JSON Schema"):
        Tool.from_function(walk)


def test_bare_values_are_typed_by_the_tool_schema() -> None:
    """Qwen3-Coder writes `<parameter=x>\\n007\\n</parameter>`: a string parameter keeps "007", an integer
    one gets 7, and the template's Python-style `True` / `None` are JSON's true / null."""

    def f(code: str, count: int, on: bool, note: str | None = None, ids: list[int] | None = None) -> str:
        return ""

    spec = Tool.from_function(f).spec
    fmt = FORMATS["qwen3_coder"]
    text = (
        "<tool_call>\n<function=f>\n<parameter=code>\n007\n</parameter>\n<parameter=count>\n7\n</parameter>\n"
        "<parameter=on>\nTrue\n</parameter>\n<parameter=note>\nNone\n</parameter>\n<parameter=ids>\n[1, 2]\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    (call,) = fmt.read(text, 0, (spec,)).message.tool_calls
    assert dict(call.arguments) == {"code": "007", "count": 7, "on": True, "note": None, "ids": [1, 2]}
    broken = fmt.read("<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>", 0, (spec,))
    assert broken.errors and not broken.message.tool_calls and "stray text" in broken.message.content


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "llama3", "mistral", "deepseek_v3", "glm45"])
def test_a_call_written_while_reasoning_is_not_run(name: str) -> None:
    """Reasoning models draft calls inside `<think>`; only the call after `</think>` is made, and a turn
    whose reasoning never closed (cut by its budget) makes none."""
    fmt = FORMATS[name]
    draft, call = fmt.write("delete_all", {}, "c00000000"), fmt.write("lookup", {"q": "x"}, "c00000001")
    turn = fmt.read(f"<think>maybe {draft}? no.</think>\n\n{call}", 0)
    assert [c.name for c in turn.message.tool_calls] == ["lookup"] and not turn.errors
    assert turn.message.content.startswith(f"<think>maybe {draft}? no.</think>")
    cut = fmt.read(f"<think>maybe {draft}", 0)
    assert not cut.message.tool_calls and not cut.errors and cut.message.content == f"<think>maybe {draft}"


class Scale:
    """A callable object as a tool."""

    def __call__(self, x: float, factor: float = 2.0) -> float:
        """Scale a number.

        Args:
            x: The number.
        """
        return x * factor


async def fetch(url: str) -> str:
    """Fetch a page (an async tool)."""
    await asyncio.sleep(0)
    return f"page {url}"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_partials_callable_objects_and_async_tools() -> None:
    tools = {
        "add": Tool.from_function(functools.partial(add, b=5)),
        "Scale": Tool.from_function(Scale()),
        "fetch": Tool.from_function(fetch),
    }
    assert [t.spec.name for t in tools.values()] == ["add", "Scale", "fetch"]
    assert tools["add"].spec.parameters["properties"]["b"] == {"type": "integer", "default": 5}
    assert tools["Scale"].spec.parameters["required"] == ["x"]
    assert tools["Scale"].spec.parameters["properties"]["x"]["description"] == "The number."
    results = [
        execute_tool_call(tools, ToolCall("c", name, args)).content
        for name, args in (("add", {"a": 1}), ("Scale", {"x": 1.5}), ("fetch", {"url": "u"}))
    ]
    assert results == ["6", "3.0", "page u"]


GLM_TEXTS = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "a <tool_call>f  </tool_call> b <tool_call>g\n</tool_call><tool_call>\n</tool_call>",
    "<tool_call>f<tool_call>g</tool_call></tool_call>",
    "<tool_call>name with spaces and no close",
)


@pytest.mark.timeout(120)
def test_a_glm_name_line_never_closed_is_read_in_one_pass() -> None:
    """A degenerate turn (the opener, then a long line with no '<' or newline, never closed) is prose. The
    call pattern takes the name whole, so this reads in one pass; with a backtracking name it was quadratic
    (about 1 s at 8,000 characters, minutes at this length). The whole-name pattern matches the same calls
    as the backtracking one (no closing tag can start inside a name)."""
    import re

    from envs.formats import _GLM_CALL

    turn = FORMATS["glm45"].read("<tool_call>" + "a" * 200_000, 0)
    assert not turn.message.tool_calls
    backtracking = re.compile(r"<tool_call>([^\n<]+)(.*?)</tool_call>", re.DOTALL)
    for text in GLM_TEXTS:
        got = [m.span() + m.groups() for m in _GLM_CALL.finditer(text)]
        assert got == [m.span() + m.groups() for m in backtracking.finditer(text)], text
    assert [len(list(_GLM_CALL.finditer(t))) for t in GLM_TEXTS] == [1, 2, 1, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "glm45"])
def test_a_turn_of_repeated_unclosed_openers_is_read_in_one_pass(name: str) -> None:
    """A degenerate turn that repeats a call's opening and never closes it is prose. Calls are matched only
    up to the last closing tag, so no opener is scanned to the end of the text for one (which took 8-13 s
    at 5,000 openers, about 16x that at this count)."""
    fmt = FORMATS[name]
    call = fmt.write("lookup", {"q": "x"}, "c00000001")
    opener = call[: len(call) // 3]
    degenerate = (opener + "a ") * 20_000
    assert not fmt.read(degenerate, 0).message.tool_calls
    turn = fmt.read(call + degenerate, 0)  # a complete call before them is still made
    assert [c.name for c in turn.message.tool_calls] == ["lookup"]
