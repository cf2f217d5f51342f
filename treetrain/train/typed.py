"""Build frozen config dataclasses from plain dicts (TOML/YAML) with errors that name the field.

Each dataclass validates its own values in `__post_init__`; this module checks structure and types
(unknown keys, wrong scalar types, nested sections) and applies `section.field=value` overrides. A
dataclass that lists `RENAMED_FIELDS` (old key -> new key) has an old key refused with the new one named,
so an earlier config file fails loudly instead of losing a setting. A library dataclass used as a section
names only its own field in a `ConfigError` (`ConfigError(..., field="root")`); the section's path is put
in front here (`rollout.fanout.root: ...`).

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Opt:
    ...     lr: float = 1e-3
    >>> from_dict(Opt, {"lr": 0.5}, "optim")
    Opt(lr=0.5)
    >>> from_dict(Opt, {"lr": "fast"}, "optim")
    Traceback (most recent call last):
    treetrain.errors.ConfigError: optim.lr: expected a number, got 'fast'
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from treetrain.errors import ConfigError
from treetrain.train.config_file import parse_value

T = TypeVar("T")

INT_MIN, INT_MAX = -(2**63), 2**63 - 1
"""Every integer in a config fits a 64-bit signed integer, whatever torch or numpy it later reaches."""
FLOAT_TINY = 1e-30
"""Smallest magnitude of a non-zero float in a config: well above float32's smallest normal (1.2e-38)."""
FLOAT_MAX = 1e30
"""Largest magnitude of a float in a config: well below float32's largest (3.4e38), so a coefficient, clip
bound or temperature never overflows in torch."""


def _show(value: Any) -> str:
    """`repr` cut to one short line (a hostile value may be megabytes long)."""
    text = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**30
        else f"an integer of {value.bit_length()} bits"
    )
    return text if len(text) <= 80 else text[:77] + "..."


def _cut(name: str) -> str:
    """A field name cut to one short line (an unknown key may be as long as the file allows)."""
    return name if len(name) <= 80 else name[:77] + "..."


def _finite_within(value: Any, where: str) -> Any:
    """`value` (any JSON-like data, e.g. `env.kwargs`), refused where it holds NaN or an infinity, naming
    the path down to it (`env.kwargs.eval_fraction`); a float field's own check says the same words."""
    stack = [(value, where)]
    while stack:
        current, path = stack.pop()
        if isinstance(current, float) and not math.isfinite(current):
            raise ConfigError(f"{path}: expected a finite number, got {current!r}")
        if isinstance(current, Mapping):
            stack.extend((v, f"{path}.{_cut(str(k))}") for k, v in current.items())
        elif isinstance(current, list | tuple):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(current))
    return value


def _check_scalar(tp: Any, value: Any, where: str) -> Any:
    if tp is Any:
        return _finite_within(value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_show(value)}")
        if not INT_MIN <= value <= INT_MAX:
            raise ConfigError(f"{where}: {_show(value)} is out of range (a 64-bit integer)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {_show(value)}")
        if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
            raise ConfigError(f"{where}: {_show(value)} is out of range")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        if value != 0 and not FLOAT_TINY <= abs(value) <= FLOAT_MAX:
            raise ConfigError(
                f"{where}: {float(value)!r} is out of range; a number in a config is 0 or between {FLOAT_TINY} "
                f"and {FLOAT_MAX} in magnitude, so that float32 arithmetic, where most end up, stays finite"
            )
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_show(value)}")
        if not value:  # `--run-dir ""` would run in the working directory, `--trees ""` match nothing
            raise ConfigError(f"{where}: must not be empty (null leaves an optional field unset)")
        return value
    raise ConfigError(f"{where}: unsupported config type {tp!r}")


def convert(tp: Any, value: Any, where: str) -> Any:
    """Check `value` against type `tp` (scalars, Optional, Literal, tuples, mappings, dataclasses)."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a section (mapping), got {_show(value)}")
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{where}: may not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {_show(value)} matches none of {tp}")
    if origin is Literal:
        choices = get_args(tp)
        # `type(...) is` too: true == 1 and 1.0 == 1 in Python, but neither is the choice 1.
        if not any(value == c and type(value) is type(c) for c in choices):
            raise ConfigError(f"{where}: must be one of {list(choices)}, got {_show(value)}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {_show(value)}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (Mapping, dict) or tp in (Mapping, dict):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {_show(value)}")
        key_t, val_t = get_args(tp) or (str, Any)
        return types.MappingProxyType(
            {convert(key_t, k, f"{where}"): convert(val_t, v, f"{where}.{k}") for k, v in value.items()}
        )
    return _check_scalar(tp, value, where)


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Construct dataclass `cls` from `data`, naming `where.field` in every error."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    prefix = f"{where}." if where else ""
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}{_show(key)}: a field name must be text")
    renamed: Mapping[str, str] = getattr(cls, "RENAMED_FIELDS", {})
    unknown = sorted(set(data) - set(fields), key=lambda key: (key not in renamed, key))
    if unknown and unknown[0] in renamed:
        raise ConfigError(f"{prefix}{unknown[0]} was renamed {prefix}{renamed[unknown[0]]}")
    if unknown:
        raise ConfigError(
            f"{prefix}{_cut(unknown[0])}: unknown field; known fields: {', '.join(sorted(fields))}"
        )
    kwargs = {name: convert(hints[name], value, f"{prefix}{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.within(where) from exc.__cause__
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from exc


def to_dict(obj: Any) -> Any:
    """A plain, YAML-ready view of a config dataclass."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    return obj


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply `a.b.c=value` to nested `data`; the value is parsed as a YAML scalar (1, 0.5, true, null, text)."""
    if "=" not in assignment:
        raise ConfigError(f"override {_show(assignment)} must look like section.field=value")
    key, raw = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {_show(assignment)} names no field")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {_cut(key)}: {_cut(p)} is not a section")
        node = child
    try:
        node[parts[-1]] = parse_value(raw)
    except ConfigError as exc:
        raise ConfigError(f"override {_cut(key.strip())}: {exc}") from None
