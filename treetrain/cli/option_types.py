"""Numeric command-line options, checked like config fields: a type, a range, a finite value.

argparse's own `type=int` and `type=float` take `nan`, `inf`, `-5` and `9223372036854775808` alike, and a
verb then prints non-finite numbers or sizes work from them. Every numeric option of every verb is a `Whole`
or a `Real` instead (`tests/cli/test_cli_fuzz.py` reads the parsers to hold every verb to it), so a value
out of range is refused at parse time, in argparse's one line that names the option (`argument
--world-size: must be in [1, 65536], got 0`), before anything loads.

Example:
    >>> Whole(1, 8)("3"), Real(0.0, 10.0, low_open=True)("1.5")
    (3, 1.5)
    >>> Whole(1, 8)("9")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: must be in [1, 8], got 9
    >>> Real(0.0, 10.0, low_open=True)("nan")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: must be a finite number, got 'nan'
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

MAX_DIGITS = 30
"""Longest whole number read (Python converts up to 4,300 digits, each one a quadratic cost)."""


@dataclass(frozen=True)
class Whole:
    """An argparse type: a whole number in [low, high], in decimal digits (no `1_000`, no `2**63`)."""

    low: int
    high: int

    def __call__(self, text: str) -> int:
        stripped = text.strip()
        digits = stripped[1:] if stripped[:1] in "+-" else stripped
        if not digits.isascii() or not digits.isdigit() or len(digits) > MAX_DIGITS:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}")
        value = int(stripped)
        if not self.low <= value <= self.high:
            shown = (
                str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}... ({len(str(value))} digits)"
            )
            raise argparse.ArgumentTypeError(f"must be in [{self.low}, {self.high}], got {shown}")
        return value


@dataclass(frozen=True)
class Real:
    """An argparse type: a finite number in [low, high], or in (low, high] with `low_open`."""

    low: float
    high: float
    low_open: bool = False

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text[:40]!r}")
        if value < self.low or value > self.high or (self.low_open and value == self.low):
            bracket = "(" if self.low_open else "["
            raise argparse.ArgumentTypeError(
                f"must be in {bracket}{self.low:g}, {self.high:g}], got {value:g}"
            )
        return value
