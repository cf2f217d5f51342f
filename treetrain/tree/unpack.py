"""Decoding untrusted msgpack: size-limited unpacking and typed field access.

Every failure is a `TreeFormatError` whose message starts with where the problem is (`file`, or a field
path such as `trees[0].nodes[3].parent`). `unpack_limited` bounds every declared length by both the
configured limit and the bytes actually present, so a header cannot make it allocate more than the input,
and refuses ext types (timestamps included) and duplicate map keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import msgpack

from treetrain.tree.schema import Limits, TreeFormatError

INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1
"""The range msgpack ints can hold."""


def short_repr(obj: object, limit: int = 60) -> str:
    """repr for error messages, cut so that a hostile value cannot flood them."""
    text = repr(obj)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


class _Rejected(Exception):
    """Raised from inside msgpack hooks; turned into a TreeFormatError by `unpack_limited`."""


def _no_ext(code: int, data: bytes) -> object:
    raise _Rejected(f"msgpack ext type {code} is not allowed in tree files")


def _unique_keys(pairs: Sequence[tuple[object, object]]) -> dict[object, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[object] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Rejected(f"duplicate map key {short_repr(k)}")
            seen.add(k)
    return out


MAP_HEADERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
"""First bytes of a msgpack map (fixmap, map 16, map 32): every tree file starts with one."""


def unpack_limited(data: bytes, limits: Limits, check_top: Callable[[object], None] | None = None) -> object:
    """Decode exactly one msgpack document filling `data`: no trailing bytes, no ext types.

    `check_top` sees the first document before trailing bytes are refused, so a file of another kind (whose
    first bytes happen to decode as a small msgpack value) is named as such, not as trailing data."""
    n = len(data)
    if n == 0:
        raise TreeFormatError("file: empty")
    if n > limits.max_file_bytes:
        raise TreeFormatError(f"file: {n} bytes exceeds the limit of {limits.max_file_bytes}")
    unpacker = msgpack.Unpacker(
        None,
        use_list=True,
        raw=False,
        strict_map_key=True,
        object_pairs_hook=_unique_keys,
        ext_hook=_no_ext,
        max_buffer_size=n,
        max_str_len=min(limits.max_str_bytes, n),
        max_bin_len=min(limits.max_bin_bytes, n),
        max_array_len=min(limits.max_array_len, n),
        max_map_len=min(limits.max_map_len, n // 2),
        max_ext_len=0,
    )
    try:
        unpacker.feed(data)
        obj = unpacker.unpack()
    except msgpack.OutOfData:
        raise TreeFormatError(
            "file: ends early (truncated, or a declared length is longer than the data or the limits)"
        ) from None
    except _Rejected as e:
        raise TreeFormatError(f"file: {e}") from None
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise TreeFormatError(f"file: not a valid msgpack document ({e})") from None
    if check_top is not None:
        check_top(obj)
    if unpacker.tell() != n:
        raise TreeFormatError(
            f"file: {n - unpacker.tell()} bytes of trailing data after the msgpack document"
        )
    return obj


def kind(obj: object) -> str:
    """The msgpack type name of a decoded value, for messages."""
    names = {type(None): "nil", bool: "bool", int: "int", float: "float", str: "str", bytes: "bin"}
    names.update({list: "array", dict: "map"})
    return names.get(type(obj), type(obj).__name__)


def expect_fields(
    obj: object, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, object]:
    """A map with every `required` key, and no key outside `required` + `optional`."""
    if not isinstance(obj, dict):
        raise TreeFormatError(f"{where}: expected a map, got {kind(obj)}")
    for key in required:
        if key not in obj:
            raise TreeFormatError(f"{where}: missing field {key!r}")
    for key in obj:
        if key not in required and key not in optional:
            known = ", ".join(required + optional)
            raise TreeFormatError(f"{where}: unknown field {short_repr(key)} (known: {known})")
    return obj


def expect_int(obj: object, where: str, lo: int = INT64_MIN, hi: int = UINT64_MAX) -> int:
    """An int (never a bool) in [lo, hi]."""
    if isinstance(obj, bool) or not isinstance(obj, int):
        raise TreeFormatError(f"{where}: expected an int, got {kind(obj)}")
    if not lo <= obj <= hi:
        raise TreeFormatError(f"{where}: {obj} is out of range [{lo}, {hi}]")
    return obj


def expect_optional_int(obj: object, where: str) -> int | None:
    return None if obj is None else expect_int(obj, where)


def expect_finite(obj: object, where: str) -> float:
    """A finite number; ints are accepted and converted."""
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        raise TreeFormatError(f"{where}: expected a number, got {kind(obj)}")
    value = float(obj)
    if not math.isfinite(value):
        raise TreeFormatError(f"{where}: {value!r} is not finite")
    return value


def expect_str(obj: object, where: str) -> str:
    if not isinstance(obj, str):
        raise TreeFormatError(f"{where}: expected a str, got {kind(obj)}")
    return obj


def expect_bin(obj: object, where: str) -> bytes:
    if not isinstance(obj, bytes):
        raise TreeFormatError(f"{where}: expected bin (bytes), got {kind(obj)}")
    return obj


def expect_array(obj: object, where: str, min_len: int = 0) -> list[object]:
    if not isinstance(obj, list):
        raise TreeFormatError(f"{where}: expected an array, got {kind(obj)}")
    if len(obj) < min_len:
        raise TreeFormatError(f"{where}: needs at least {min_len} element(s), got {len(obj)}")
    return obj
