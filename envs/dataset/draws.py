"""Which row a seed draws: a held-out split set aside once, and a fresh permutation of the rest per epoch.

The held-out split is `eval_path`'s rows, or an `eval_fraction` of the task file chosen by a fixed shuffle of
row numbers (the same rows for every run and run seed, so evaluations of different runs compare). Training
draws only the other rows: seed `s` is position `s mod N` of epoch `s div N`, whose permutation is seeded
by the epoch, so N consecutive seeds starting at a multiple of N draw every training row once, and the
trainer's task seeds (`seed * 1_000_003 + update * groups_per_update + g`) walk the permutations in order,
starting where the run seed puts them. An evaluation seed `i` is held-out row `i mod M`, in file order.

Tables are kept per worker process (`tables`), keyed by the file's identity, so building an environment for
every episode reads and validates a file once.

Example:
    >>> split = Split.of(range(1, 11), eval_fraction=0.2)
    >>> len(split.train), len(split.held_out), set(split.train) & set(split.held_out)
    (8, 2, set())
    >>> sorted(draw(split.train, s) for s in range(8)) == sorted(split.train)
    True
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from envs.dataset.rows import TaskFileError, TaskRow, read_rows

HELD_OUT_SEED = "treetrain-dataset-held-out"
"""Seeds the shuffle that picks the `eval_fraction` rows (fixed: held-out rows never depend on the run)."""


@dataclass(frozen=True)
class Split:
    """Row indices (0-based) that training draws, and those held out for evaluation."""

    train: tuple[int, ...]
    held_out: tuple[int, ...]

    @staticmethod
    def of(indices: Iterable[int], eval_fraction: float = 0.0) -> Split:
        """Hold out `ceil(eval_fraction * N)` of `indices` by a fixed shuffle; at least one row trains."""
        rows = list(indices)
        if not 0.0 <= eval_fraction < 1.0:
            raise TaskFileError(f"eval_fraction: must be in [0, 1), got {eval_fraction!r}")
        count = math.ceil(eval_fraction * len(rows))
        if count >= len(rows):
            raise TaskFileError(f"eval_fraction: {eval_fraction} of {len(rows)} rows leaves none to train on")
        shuffled = rows[:]
        random.Random(HELD_OUT_SEED).shuffle(shuffled)
        held = set(shuffled[:count])
        return Split(tuple(i for i in rows if i not in held), tuple(i for i in rows if i in held))


@functools.lru_cache(maxsize=8)
def _permutation(size: int, epoch: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"epoch-{epoch}").shuffle(order)
    return tuple(order)


def draw(rows: Sequence[int], seed: int) -> int:
    """The row index seed `seed` draws from `rows` (see the module docstring)."""
    epoch, position = divmod(seed, len(rows))
    return rows[_permutation(len(rows), epoch)[position]]


@dataclass(frozen=True)
class Tables:
    """The task file's rows and the split, as one environment sees them."""

    rows: tuple[TaskRow, ...]
    """The task file's rows, then `eval_path`'s when given."""
    split: Split


def _identity(path: str) -> tuple[str, int, int]:
    stat = os.stat(path)
    return str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size


def tables(path: str, eval_path: str | None, eval_fraction: float, needs: tuple[str, ...]) -> Tables:
    """The rows and split for these settings, read once per process while the files are unchanged."""
    if eval_path is not None and eval_fraction:
        raise TaskFileError("eval_path and eval_fraction: give one way to hold tasks out, not both")
    for name, where in (("path", path), ("eval_path", eval_path)):
        if where is not None and not os.path.exists(where):
            read_rows(where, needs, name)  # raises the one-line refusal
    key = (_identity(path), _identity(eval_path) if eval_path else None)
    return _tables(key, path, eval_path, eval_fraction, needs)


@functools.lru_cache(maxsize=4)
def _tables(
    key: object, path: str, eval_path: str | None, eval_fraction: float, needs: tuple[str, ...]
) -> Tables:
    del key  # part of the cache key only
    rows = read_rows(path, needs, "path")
    if eval_path is None:
        return Tables(rows, Split.of(range(len(rows)), eval_fraction))
    held = read_rows(eval_path, needs, "eval_path")
    return Tables(rows + held, Split(tuple(range(len(rows))), tuple(range(len(rows), len(rows) + len(held)))))
