"""JSON Schema for tool parameters: checked when a tool is built, enforced with `jsonschema` on every call.

A tool's `parameters` is an OpenAI-style JSON Schema object. Two things go wrong in real tool lists: type
names that are not JSON Schema (`dict`, `float`, `tuple`, `any`, as in some published function-calling
data sets), which a validator would silently ignore, and schemas that are not valid at all. Both are
refused when the tool is built, naming the field. Arguments are then validated with a real JSON Schema
validator (Draft 2020-12, formats checked): nested objects, arrays, enums, required fields, formats.

`schema_for(annotation)` turns Python typing into JSON Schema for `Tool.from_function`: `str`, `int`,
`float`, `bool`, `list[X]`, `set[X]`, `dict[str, X]`, `tuple[X, ...]`, `X | None` / `Optional[X]`,
`Union`, `Literal[...]`, `Enum` classes, dataclasses, `TypedDict`s, `Annotated[X, "description"]` and
`Any`; `from_json(annotation, value)` turns validated JSON back into those types (an `Enum` member, a
dataclass instance, a set) before the tool runs.

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

import dataclasses
import enum
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


def _remote_ref(schema: Any, where: str) -> str | None:
    """The first `$ref` that does not point inside the schema: resolving it would need the network."""
    if isinstance(schema, Mapping):
        ref = schema.get("$ref")
        if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
            return (
                f"{where}.$ref: {ref!r} is not a local reference ('#/$defs/...'); tools cannot fetch schemas"
            )
        items: Any = schema.items()
    elif isinstance(schema, list):
        items = enumerate(schema)
    else:
        return None
    for key, sub in items:
        found = _remote_ref(sub, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}")
        if found:
            return found
    return None


def _key(schema: Mapping[str, Any]) -> str:
    """The schema as canonical JSON text; read-only mappings (`MappingProxyType`) count as objects."""
    return json.dumps(
        schema, sort_keys=True, default=lambda v: dict(v) if isinstance(v, Mapping) else repr(v)
    )


@functools.lru_cache(maxsize=512)
def _checked(key: str) -> str | None:
    schema = json.loads(key)
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return 'parameters: must be a JSON Schema object with "type": "object"'
    found = _type_problem(schema, "parameters") or _remote_ref(schema, "parameters")
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
    try:
        error = best_match(_validator(_key(parameters)).iter_errors(dict(arguments)))
    except (jsonschema.exceptions.JsonSchemaException, RecursionError, ValueError, LookupError) as exc:
        return f"the schema could not check them ({type(exc).__name__}: {str(exc)[:200]})"
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
    if annotation in (set, frozenset) or origin in (set, frozenset, typing.AbstractSet):
        item = {"items": schema_for(args[0], where)} if args else {}
        return {"type": "array", "uniqueItems": True, **item}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        values = [m.value for m in annotation]
        kinds = {simple.get(type(v)) for v in values}
        return {**({"type": kinds.pop()} if len(kinds) == 1 and None not in kinds else {}), "enum": values}
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        hints = typing.get_type_hints(annotation, include_extras=True)
        fields = [f for f in dataclasses.fields(annotation) if f.init]
        props = {f.name: schema_for(hints[f.name], f"{where}.{f.name}") for f in fields}
        required = [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if typing.is_typeddict(annotation):
        hints = typing.get_type_hints(annotation, include_extras=True)
        props = {k: schema_for(_unrequired(t), f"{where}.{k}") for k, t in hints.items()}
        required = [k for k in hints if k in annotation.__required_keys__]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if annotation in (dict, Mapping) or origin in (dict, Mapping):
        if args and args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings, so use dict[str, ...], not {annotation}")
        return {"type": "object", **({"additionalProperties": schema_for(args[1], where)} if args else {})}
    raise TypeError(
        f"{where}: annotation {annotation!r} has no JSON Schema; use str, int, float, bool, list[...], "
        "set[...], dict[str, ...], tuple[...], Optional[...], Literal[...], an Enum, a dataclass, a TypedDict or Any"
    )


def _unrequired(annotation: Any) -> Any:
    """`X` for `typing.Required[X]` / `typing.NotRequired[X]` (TypedDict markers), else the annotation."""
    if typing.get_origin(annotation) in (typing.Required, typing.NotRequired):
        return typing.get_args(annotation)[0]
    return annotation


def from_json(annotation: Any, value: Any) -> Any:
    """A validated JSON value as the Python type `annotation` names: an `Enum` member, a dataclass
    instance, a set or frozenset, a tuple, recursively through lists, dicts and unions. Plain JSON types
    are returned as they are.

    >>> import enum
    >>> class Unit(enum.Enum):
    ...     C = "celsius"
    >>> from_json(list[Unit], ["celsius"]), from_json(set[int] | None, [2, 1])
    ([<Unit.C: 'celsius'>], {1, 2})
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return from_json(args[0], value)
    if origin in (typing.Union, types.UnionType):
        for arg in args:  # the first member the value fits, as the schema's anyOf accepted it
            if _fits(arg, value):
                return from_json(arg, value)
        return value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation(value)
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation) and isinstance(value, dict):
        hints = typing.get_type_hints(annotation, include_extras=True)
        return annotation(**{k: from_json(hints.get(k, Any), v) for k, v in value.items()})
    if typing.is_typeddict(annotation) and isinstance(value, dict):
        hints = typing.get_type_hints(annotation, include_extras=True)
        return {k: from_json(_unrequired(hints.get(k, Any)), v) for k, v in value.items()}
    if isinstance(value, list):
        if annotation in (set, frozenset) or origin in (set, frozenset, typing.AbstractSet):
            kind = frozenset if frozenset in (annotation, origin) else set
            return kind(from_json(args[0], v) if args else v for v in value)
        if annotation is tuple or origin is tuple:
            if args and not (len(args) == 2 and args[1] is Ellipsis):
                return tuple(from_json(a, v) for a, v in zip(args, value, strict=False))
            return tuple(from_json(args[0], v) if args else v for v in value)
        if origin in (list, Sequence) and args:
            return [from_json(args[0], v) for v in value]
    if isinstance(value, dict) and origin in (dict, Mapping) and len(args) == 2:
        return {k: from_json(args[1], v) for k, v in value.items()}
    return value


def _fits(annotation: Any, value: Any) -> bool:
    try:
        schema = schema_for(annotation)
    except TypeError:
        return False
    return _VALIDATOR(schema).is_valid(value)
