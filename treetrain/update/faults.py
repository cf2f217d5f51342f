"""Which replay failures an update window may retry, and which it must raise at once.

A retry (or a window reset) can get past a transient fault: out of memory, a failed backward, a collective
or I/O error. A bug or bad input would fail the same way again, so it is raised on the spot, without retry
and without dropping anything.
"""

from __future__ import annotations

from treetrain.loss.manifest import ManifestError
from treetrain.memory.retention import BudgetTooSmallError
from treetrain.models.support import UnsupportedModelError
from treetrain.replay import BackwardFailed, StaleResidentStateError

TRANSIENT: tuple[type[BaseException], ...] = (RuntimeError, OSError)
"""Faults a retry or a window reset can get past: out of memory (`torch.OutOfMemoryError` is a
`RuntimeError`), a failed backward (`BackwardFailed`), a collective or I/O error."""
PERMANENT: tuple[type[BaseException], ...] = (
    ValueError, TypeError, IndexError, KeyError, NotImplementedError, StaleResidentStateError,
    ManifestError, UnsupportedModelError, BudgetTooSmallError,
)  # fmt: skip
"""Bugs and bad input: a retry would fail the same way. Some are `RuntimeError`s, so this list wins."""


def is_transient(exc: BaseException) -> bool:
    """Whether a replay failure may be retried: a `TRANSIENT` kind that is not `PERMANENT`. A
    `BackwardFailed` is judged by the error that made backward fail.

    >>> is_transient(RuntimeError("CUDA error")), is_transient(ManifestError("bad")), is_transient(KeyError(1))
    (True, False, False)
    """
    cause = exc.__cause__ if isinstance(exc, BackwardFailed) and exc.__cause__ is not None else exc
    return isinstance(cause, TRANSIENT) and not isinstance(cause, PERMANENT)
