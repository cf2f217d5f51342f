"""Reading config text (files and `--set` values) as untrusted input, with limits.

A config file is read as bytes up to `MAX_CONFIG_BYTES`, must be UTF-8, and is parsed by a YAML loader that
refuses duplicate keys and nesting deeper than `MAX_DEPTH`, and that counts nodes with aliases expanded, so a
"billion laughs" alias bomb is refused after `MAX_NODES` nodes instead of hanging whatever walks the result.
TOML (which refuses duplicate keys itself) gets the same depth and size checks. YAML here reads `5e-4` as a
number (as YAML 1.2 and TOML do), so a string is never silently taken for a number later.

Every error is a `ConfigError` naming the file (or the override) and the problem.

Example:
    >>> parse_value("5e-4"), parse_value("true"), parse_value("*.msgpack")
    (0.0005, True, '*.msgpack')
    >>> parse_yaml("a: 1\\na: 2\\n", "c.yaml")
    Traceback (most recent call last):
    treetrain.errors.ConfigError: config file c.yaml: line 2: duplicate key 'a'
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from treetrain.errors import ConfigError
from treetrain.io import open_regular, path_problem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MAX_CONFIG_BYTES = 64 << 10
"""Largest config file read (a config is a few hundred bytes; this leaves room for long env kwargs)."""
MAX_DEPTH = 32
"""Deepest nesting of sections, lists and mappings (the config itself is three levels deep)."""
MAX_NODES = 10_000
"""Most values in one config, aliases expanded."""
MAX_STRING = 65_536
"""Longest string value or key, in characters."""

_MERGE = "tag:yaml.org,2002:merge"


class _LimitedLoader(yaml.SafeLoader):
    """SafeLoader with a composition depth limit, duplicate keys refused, and YAML 1.2 exponent floats."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:  # type: ignore[override]
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"line {mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE or not isinstance(key_node, ScalarNode):
                continue
            key = self.construct_object(key_node)
            try:
                duplicate = key in seen
            except TypeError:
                continue
            if duplicate:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_LimitedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _check_graph(node: Node) -> None:
    """The composed YAML graph with aliases expanded, within the limits (an alias bomb stops early)."""
    _walk(node, _node_children, " once aliases are expanded")


def _check_data(data: Any) -> None:
    """Depth, size and string checks on parsed values (TOML's, and YAML's after construction)."""
    _walk(data, _data_children, "", _check_string)


def _walk(
    root: Any, children: Callable[[Any], list[Any]], where: str, check: Callable[[Any], None] | None = None
) -> None:
    """Visit every value under `root`, stopping at the first limit exceeded: the work is bounded by
    `MAX_NODES` whatever the input claims. `where` ends the limits' messages."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    count = 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ConfigError(f"more than {MAX_NODES} values{where}")
        if depth > MAX_DEPTH:
            raise ConfigError(f"nested deeper than {MAX_DEPTH} levels{where}")
        if check is not None:
            check(value)
        stack.extend((child, depth + 1) for child in children(value))


def _node_children(node: Any) -> list[Any]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _data_children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [part for pair in value.items() for part in pair]
    return list(value) if isinstance(value, list | tuple) else []


def _check_string(value: Any) -> None:
    if not isinstance(value, str):
        return
    if len(value) > MAX_STRING:
        raise ConfigError(f"a string of {len(value)} characters (the limit is {MAX_STRING})")
    if "\x00" in value:
        raise ConfigError(f"a string holds a NUL character: {value[:40]!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"a string is not valid Unicode ({exc.reason}): {value[:40]!r}") from None


def _flow_depth(text: str) -> int:
    """Deepest `[`/`{` nesting outside quotes and comments, in one linear pass.

    PyYAML's scanner looks ahead to the end of an unclosed flow collection at every level (quadratic work),
    so nesting is measured before it runs. Brackets inside plain scalars count too, which can only
    overestimate.
    """
    depth = deepest = 0
    quote = ""
    previous = "\n"
    for ch in text:
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and previous in " \t\n":
            quote = "\n"  # a comment runs to the end of the line
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
        previous = ch
    return deepest


def _load_yaml(text: str) -> Any:
    if _flow_depth(text) > MAX_DEPTH:
        raise ConfigError(f"nested deeper than {MAX_DEPTH} levels")
    loader = _LimitedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_graph(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_yaml(text: str, where: str) -> Any:
    """YAML text, within the limits; errors name `where`."""
    try:
        data = _load_yaml(text)
        _check_data(data)
    except ConfigError as exc:
        raise ConfigError(f"config file {where}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {where} is not valid YAML: {' '.join(str(exc).split())}") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer beyond Python's digit limit
        raise ConfigError(f"config file {where} is not valid YAML: {exc}") from None
    return data


def _toml_reason(exc: tomllib.TOMLDecodeError, text: str) -> str:
    """tomllib's message, naming the key when it says a value is set twice (it gives only the position)."""
    reason = str(exc)
    found = re.search(r"\(at line (\d+), column \d+\)$", reason)
    if not found or "Cannot overwrite a value" not in reason:
        return reason
    number = int(found.group(1))
    lines = text.splitlines()
    line = lines[number - 1] if 0 < number <= len(lines) else ""
    key = line.split("=", 1)[0].strip().strip("[]").strip()
    return f"line {number}: duplicate key {key[:80]!r}" if key else reason


def parse_toml(text: str, where: str) -> Any:
    """TOML text, within the limits; errors name `where`."""
    try:
        data = tomllib.loads(text)
        _check_data(data)
    except ConfigError as exc:
        raise ConfigError(f"config file {where}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {where} is not valid TOML: {_toml_reason(exc, text)}") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"config file {where} is not valid TOML: {exc}") from None
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML (.toml) or YAML (.yaml/.yml) file as a dict, read as untrusted input."""
    p = Path(path)
    problem = path_problem(p, "file")  # a FIFO or a device would block or never end
    if problem is not None:
        raise ConfigError(f"config file: {problem}")
    if p.suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"config file {p}: not a config file; use .toml, .yaml or .yml")
    try:
        with open_regular(p) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config file {p}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:  # an embedded NUL in the path
        raise ConfigError(f"config file {p!r}: {exc}") from None
    return parse_config_bytes(raw, p.suffix, str(p))


def parse_config_bytes(raw: bytes, suffix: str, where: str) -> dict[str, Any]:
    """Config bytes already read (at most `MAX_CONFIG_BYTES + 1` of them) as a dict, within the limits.

    Example:
        >>> parse_config_bytes(b"- a list\\n", ".yaml", "runs/x/config.yaml")
        Traceback (most recent call last):
        treetrain.errors.ConfigError: config file runs/x/config.yaml: the top level must be a mapping, got list
    """
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {where} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {where} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ) from None
    data = parse_toml(text, where) if suffix == ".toml" else parse_yaml(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {where}: the top level must be a mapping, got {type(data).__name__}")
    return data


def parse_value(raw: str) -> Any:
    """An override's value: a YAML scalar or flow value (1, 0.5, 5e-4, true, null, [1, 2]) or else the text."""
    if not raw.strip():
        return ""
    try:
        data = _load_yaml(raw)
        _check_data(data)
    except ConfigError:
        raise
    except (yaml.YAMLError, ValueError, RecursionError):  # e.g. a glob like *.msgpack: take it as text
        data = raw
        _check_data(data)
    return data
