"""JSON-schema tools: schemas checked when a tool is built, arguments validated with jsonschema, and
`Tool.from_function` for the typing real tool code uses."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pytest

from envs import ProtocolError, Tool, ToolCall, ToolSpec, execute_tool_call, tools_from_openai

ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"email": {"type": "string", "format": "email"}, "vip": {"type": "boolean"}},
            "required": ["email"],
        },
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
            },
        },
        "speed": {"type": "string", "enum": ["standard", "express"]},
        "day": {"type": "string", "format": "date"},
    },
    "required": ["customer", "lines"],
}
GOOD = {"customer": {"email": "a@b.org"}, "lines": [{"sku": "X1", "qty": 2}], "speed": "express"}


def _call(arguments: dict[str, Any]) -> str:
    tools = tools_from_openai(
        [
            {
                "type": "function",
                "function": {"name": "order", "description": "Place an order.", "parameters": ORDER},
            }
        ],
        lambda name, args: {"tool": name, "lines": len(args["lines"])},
    )
    return execute_tool_call({t.spec.name: t for t in tools}, ToolCall("c0", "order", arguments)).content


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"customer": {"email": "a@b.org"}}, "missing required argument(s) ['lines']"),
        ({**GOOD, "customer": {"vip": True}}, "argument 'customer': 'email' is a required property"),
        ({**GOOD, "customer": {"email": "not-an-email"}}, "'not-an-email' is not a 'email'"),
        (
            {**GOOD, "lines": [{"sku": "X1", "qty": 0}]},
            "argument 'lines'[0]['qty']: 0 is less than the minimum of 1",
        ),
        (
            {**GOOD, "lines": [{"sku": "X1", "qty": "2"}]},
            "argument 'lines'[0]['qty']: '2' is not of type 'integer'",
        ),
        (
            {**GOOD, "speed": "overnight"},
            "argument 'speed': 'overnight' is not one of ['standard', 'express']",
        ),
        ({**GOOD, "day": "2026-13-45"}, "argument 'day': '2026-13-45' is not a 'date'"),
        ({**GOOD, "coupon": "FREE"}, "unexpected argument(s) ['coupon']"),
    ],
)
def test_arguments_are_validated_against_the_schema(arguments: dict[str, Any], problem: str) -> None:
    content = _call(arguments)
    assert content.startswith("Error: bad arguments for 'order': ") and problem in content


def test_valid_arguments_reach_the_dispatch_function() -> None:
    assert _call(GOOD) == '{"tool": "order", "lines": 1}'
    assert _call({**GOOD, "day": "2026-11-30"}) == '{"tool": "order", "lines": 1}'


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"type": "object", "properties": {"x": {"type": "float"}}}, "parameters.properties.x.type: 'float'"),
        ({"type": "dict", "properties": {}}, 'must be a JSON Schema object with "type": "object"'),
        (
            {"type": "object", "properties": {"p": {"type": "array", "items": {"type": "tuple"}}}},
            "parameters.properties.p.items.type: 'tuple' is not a JSON Schema type (use 'array')",
        ),
        (
            {"type": "object", "properties": {"o": {"type": "object", "properties": {"v": {"type": "any"}}}}},
            "parameters.properties.o.properties.v.type: 'any' is not a JSON Schema type (leave 'type' out",
        ),
        (
            {"type": "object", "properties": {"e": {"enum": "abc"}}},
            "parameters.properties.e.enum: 'abc' is not of type 'array'",
        ),
        ({"type": "object", "required": "x"}, "parameters.required: 'x' is not of type 'array'"),
    ],
)
def test_non_standard_schemas_are_refused_when_built(parameters: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtocolError, match="tool 'f'") as info:
        ToolSpec("f", "", parameters)
    assert field in str(info.value)
    with pytest.raises(ProtocolError):
        tools_from_openai([{"name": "f", "parameters": parameters}], lambda n, a: None)


def convert(
    amounts: list[float],
    rates: dict[str, int],
    unit: Literal["C", "F"] = "C",
    note: str | None = None,
    pair: tuple[int, str] = (1, "a"),
    tag: Annotated[str, "a free-form label"] = "",
    extra: Any = None,
) -> str:
    """Convert amounts.

    Longer explanation that is not the summary.

    Args:
        amounts: The amounts to convert,
            one per line item.
        rates: Exchange rate per currency code.
        unit: Temperature unit.
    """
    return f"{sum(amounts)} {sorted(rates)} {unit} {note}"


def convert_numpy(amounts: list[float], scale: float = 1.0) -> float:
    """Scale amounts.

    Parameters
    ----------
    amounts : list of float
        The amounts.
    scale : float
        The factor.
    """
    return sum(amounts) * scale


def test_from_function_supports_real_typing_and_docstrings() -> None:
    spec = Tool.from_function(convert).spec
    props = spec.parameters["properties"]
    assert spec.description == "Convert amounts."
    assert spec.parameters["required"] == ["amounts", "rates"]
    assert props["amounts"] == {
        "type": "array",
        "items": {"type": "number"},
        "description": "The amounts to convert, one per line item.",
    }
    assert props["rates"] == {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "description": "Exchange rate per currency code.",
    }
    assert props["unit"] == {
        "type": "string",
        "enum": ["C", "F"],
        "description": "Temperature unit.",
        "default": "C",
    }
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    assert props["pair"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    assert props["tag"]["description"] == "a free-form label" and props["extra"] == {"default": None}
    numpy = Tool.from_function(convert_numpy).spec
    assert numpy.parameters["properties"]["scale"]["description"] == "The factor."
    assert numpy.description == "Scale amounts."
    tool = Tool.from_function(convert)
    ok = ToolCall("c", "convert", {"amounts": [1, 2.5], "rates": {"EUR": 2}, "unit": "F"})
    assert execute_tool_call({"convert": tool}, ok).content == "3.5 ['EUR'] F None"
    bad = ToolCall("c", "convert", {"amounts": [1], "rates": {"EUR": 2}, "unit": "K"})
    assert "'K' is not one of ['C', 'F']" in execute_tool_call({"convert": tool}, bad).content


def test_from_function_refuses_what_json_cannot_carry() -> None:
    def f(x: bytes) -> None: ...

    def g(x: dict[int, str]) -> None: ...

    def h(x) -> None: ...  # type: ignore[no-untyped-def]

    for fn, msg in (
        (f, "parameter 'x': annotation"),
        (g, "use dict[str, ...]"),
        (h, "needs a type annotation"),
    ):
        with pytest.raises(ProtocolError, match=msg.replace("[", r"\[").replace("(", r"\(")):
            Tool.from_function(fn)
