"""JSON Schema for tool parameters: checked when a tool is built, enforced with `jsonschema` on every call.

A tool's `parameters` is an OpenAI-style JSON Schema object. Two things go wrong in real tool lists: type
names that are not JSON Schema (`dict`, `float`, `tuple`, `any`, as in some published function-calling
data sets), which a validator would silently ignore, and schemas that are not valid at all. Both are
refused when the tool is built, naming the field. Arguments are then validated with a real JSON Schema
validator (Draft 2020-12, formats checked): nested objects, arrays, enums, required fields, formats.

`schema_for(annotation)` turns Python typing into JSON Schema for `Tool.from_function`: `str`, `int`,
`float`, `bool`, `list[X]`, `dict[str, X]`, `tuple[X, ...]`, `X | None` / `Optional[X]`, `Union`,
`Literal[...]`, `Annotated[X, "description"]` and `Any`.

Example:
    >>> from typing import Literal, Optional
    >>> schema_for(list[float])
    {'type': 'array', 'items': {'type': 'number'}}
    >>> schema_for(Optional[Literal["C", "F"]])
    {'anyOf': [{'type': 'string', 'enum': ['C', 'F']}, {'type': 'null'}]}
    >>> parameters_problem({"type": "object", "properties": {"x": {"type": "float"}}})
    "parameters.properties.x.type: 'float' is not a JSON Schema type (use 'number')"
    >>> arguments_problem({"type": "object", "properties": {"x": {"type": "number"}}}, {"x": "a"})
    "argument 'x': 'a' is not of type 'number'"
"""

from __future__ import annotations

import functools
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_FIXES = {
    "dict": "object",
    "float": "number",
    "double": "number",
    "int": "integer",
    "long": "integer",
    "str": "string",
    "bool": "boolean",
    "list": "array",
    "tuple": "array",
    "any": "leave 'type' out to allow any value",
    "none": "null",
}
# Keywords whose value is one schema, a list of schemas, or a mapping of names to schemas.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")
_VALIDATOR = jsonschema.Draft202012Validator


def _type_problem(schema: Mapping[str, Any], where: str) -> str | None:
    kind = schema.get("type")
    for name in kind if isinstance(kind, list) else [kind] if kind is not None else []:
        if name not in JSON_TYPES:
            fix = _FIXES.get(str(name).lower())
            hint = f" (use {fix!r})" if fix and not fix.startswith("leave") else f" ({fix})" if fix else ""
            return f"{where}.type: {name!r} is not a JSON Schema type{hint}"
    for key in _ONE:
        if isinstance(schema.get(key), Mapping):
            found = _type_problem(schema[key], f"{where}.{key}")
            if found:
                return found
    for key in _MANY:
        for i, sub in enumerate(schema.get(key) or ()):
            if isinstance(sub, Mapping) and (found := _type_problem(sub, f"{where}.{key}[{i}]")):
                return found
    for key in _NAMED:
        named = schema.get(key)
        if isinstance(named, Mapping):
            for name, sub in named.items():
                if isinstance(sub, Mapping) and (found := _type_problem(sub, f"{where}.{key}.{name}")):
                    return found
    return None


def _key(schema: Mapping[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True, default=repr)


@functools.lru_cache(maxsize=512)
def _checked(key: str) -> str | None:
    schema = json.loads(key)
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return 'parameters: must be a JSON Schema object with "type": "object"'
    found = _type_problem(schema, "parameters")
    if found:
        return found
    try:
        _VALIDATOR.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        return f"parameters{path}: {exc.message}"
    return None


def parameters_problem(parameters: Mapping[str, Any]) -> str | None:
    """Why `parameters` cannot describe a tool's arguments (the field named), or None when it can."""
    try:
        key = _key(parameters)
    except (TypeError, ValueError) as exc:
        return f"parameters: not JSON ({exc})"
    return _checked(key)


@functools.lru_cache(maxsize=512)
def _validator(key: str) -> Any:
    return _VALIDATOR(json.loads(key), format_checker=_VALIDATOR.FORMAT_CHECKER)


def arguments_problem(parameters: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """Why `arguments` do not fit `parameters` (one line, the argument named), or None when they do.

    Arguments that the schema does not list are refused unless it sets `additionalProperties`: a Python
    function cannot take an argument it does not declare.
    """
    props = parameters.get("properties") or {}
    required = [p for p in parameters.get("required", ()) if p not in arguments]
    if required:
        return f"missing required argument(s) {required}"
    if "additionalProperties" not in parameters:
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"unexpected argument(s) {unknown}; expected {sorted(props)}"
    error = best_match(_validator(_key(parameters)).iter_errors(dict(arguments)))
    if error is None:
        return None
    path = "".join(f"[{p!r}]" if i else repr(p) for i, p in enumerate(error.absolute_path))
    return f"argument {path}: {error.message}" if path else error.message


def schema_for(annotation: Any, where: str = "parameter") -> dict[str, Any]:
    """The JSON Schema of a Python annotation; `TypeError` naming `where` for one JSON cannot carry."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    simple = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
    if annotation in simple:
        return {"type": simple[annotation]}
    if annotation is Any:
        return {}
    if origin is typing.Annotated:
        out = schema_for(args[0], where)
        notes = [a for a in args[1:] if isinstance(a, str)]
        return {**out, "description": notes[0]} if notes else out
    if origin is typing.Literal:
        kinds = {simple.get(type(a)) for a in args}
        out = {"type": kinds.pop()} if len(kinds) == 1 and None not in kinds else {}
        return {**out, "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [schema_for(a, where) for a in args]}
    if annotation in (list, Sequence) or origin in (list, Sequence):
        return {"type": "array", **({"items": schema_for(args[0], where)} if args else {})}
    if annotation is tuple or origin is tuple:
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            return {"type": "array", **({"items": schema_for(args[0], where)} if args else {})}
        items = [schema_for(a, where) for a in args]
        return {"type": "array", "prefixItems": items, "minItems": len(items), "maxItems": len(items)}
    if annotation in (dict, Mapping) or origin in (dict, Mapping):
        if args and args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings, so use dict[str, ...], not {annotation}")
        return {"type": "object", **({"additionalProperties": schema_for(args[1], where)} if args else {})}
    raise TypeError(
        f"{where}: annotation {annotation!r} has no JSON Schema; use str, int, float, bool, list[...], "
        "dict[str, ...], tuple[...], Optional[...], Literal[...] or Any"
    )
