"""Bytes by lifetime class: the unit both the ledger (predicted) and the tracker (measured) speak.

The four classes follow the ledger of docs/design.md. treetrain books them as follows:

- `persistent` (run-persistent): parameters, optimizer state (and fp32 master weights), ZeRO buffers, the
  reference model. They exist for the whole run.
- `prompt_group`: resident KV of the tree being replayed and, in `exact` mode, its KV-gradient
  accumulators G. They live from a unit's first forward to its own replay step.
- `temporary` (replay-temporary): the live graph of the K branches of the current step, logits, the past
  assembled for a forward, recompute scratch. They die with the step.
- `boundary` (update-boundary): accumulated parameter gradients (and the manifest, which is host memory).
  They live from an update window's first backward to its optimizer step. Gradient buffers could be
  counted as run-persistent too; treetrain books them here, whole, from the start of the window, which is
  what a ZeRO engine's preallocated gradient buffers do and a safe bound for `.grad`s created lazily by
  the first backward.

Example:
    >>> a = ClassBytes(persistent=100, temporary=20)
    >>> (a + ClassBytes(prompt_group=5)).total, a.dynamic
    (125, 20)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

LifetimeClass = Literal["persistent", "prompt_group", "temporary", "boundary"]
CLASSES: tuple[LifetimeClass, ...] = ("persistent", "prompt_group", "temporary", "boundary")


@dataclass(frozen=True)
class ClassBytes:
    """Bytes per lifetime class at one moment."""

    persistent: int = 0
    """Parameters, optimizer state, the reference model."""
    prompt_group: int = 0
    """Resident KV and KV-gradient accumulators."""
    temporary: int = 0
    """Live graphs, logits and scratch of the current step."""
    boundary: int = 0
    """Accumulated parameter gradients."""

    @property
    def total(self) -> int:
        return self.persistent + self.prompt_group + self.temporary + self.boundary

    @property
    def dynamic(self) -> int:
        """Everything but run-persistent bytes: what the schedule controls."""
        return self.total - self.persistent

    def get(self, cls: LifetimeClass) -> int:
        return int(getattr(self, cls))

    def __add__(self, other: ClassBytes) -> ClassBytes:
        return ClassBytes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: ClassBytes) -> ClassBytes:
        return ClassBytes(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, int]:
        return {c: self.get(c) for c in CLASSES} | {"total": self.total}


def larger(a: ClassBytes | None, b: ClassBytes | None) -> ClassBytes | None:
    """The one with the larger total (either may be missing)."""
    if a is None:
        return b
    if b is None:
        return a
    return b if b.total > a.total else a
