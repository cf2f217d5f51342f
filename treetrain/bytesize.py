"""Byte sizes for humans: parse '8GiB' / '1.5GB' / '512MiB' / '123', and print them back.

Example:
    >>> parse_bytes("1.5GiB"), format_bytes(3 * 2**20)
    (1610612736, '3.0 MiB')
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
MAX_BYTES = 2**60
"""1 EiB: far above any machine, far below where float rounding or int overflow begins."""
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Bytes in `text`; decimal (GB) and binary (GiB) units, case-insensitive. Raises ValueError."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"byte size must be >= 0, got {text}")
        if text > MAX_BYTES:
            raise ValueError(
                f"byte size {text} is larger than the most this accepts ({format_bytes(MAX_BYTES)})"
            )
        return text
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        shown = repr(str(text)[:40]) + ("..." if len(str(text)) > 40 else "")
        raise ValueError(f"cannot read {shown} as a byte size; use e.g. 8GiB, 512MiB, 1.5GB or 1000000")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_BYTES:
        shown = repr(str(text)[:40])
        raise ValueError(
            f"byte size {shown} is larger than the most this accepts ({format_bytes(MAX_BYTES)})"
        )
    return int(value)


def format_bytes(n: float) -> str:
    """A short binary-unit rendering, e.g. '1.5 GiB'."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
