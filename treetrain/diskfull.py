"""A full disk, whatever wrote to it, is one `DiskFullError` line naming the directory and the space needed.

Every write of a run (checkpoints through torch's zip writer and safetensors, tree files, metrics, the
config, the summary) goes through `treetrain.io`'s atomic writes or an append, so a full disk never leaves a
half-written file; but each writer reports it in its own words. `os.write` raises `OSError(ENOSPC)`; torch's
checkpoint writer `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 930112 vs
930004`; safetensors `SafetensorError: ... No space left on device`. `is_disk_full` recognizes all of them
(and the causes they chain), and `naming_full_disk` turns them into one line:

    /runs/r/checkpoints: no space left on the device: this write needs at least 4.3 MiB and 48.0 KiB is
    free; free some space there or use another --run-dir

Example:
    >>> import errno
    >>> is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    True
    >>> is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 930112 vs 930004"))
    True
    >>> is_disk_full(ValueError("bad value"))
    False
    >>> with naming_full_disk("/tmp", 2048):
    ...     raise OSError(errno.ENOSPC, "No space left on device")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    treetrain.diskfull.DiskFullError: /tmp: no space left on the device: this write needs 2.0 KiB and ... is free; ...
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from treetrain.bytesize import format_bytes
from treetrain.errors import TreetrainError

_CODES = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_WORDS = ("no space left on device", "disk quota exceeded")
_TORCH_SHORT_WRITE = "unexpected pos"
"""What torch's zip writer (`inline_container.cc`) says when a write came up short: the disk filled."""


class DiskFullError(TreetrainError, OSError):
    """A write found the disk (or the quota) full; the message names the directory and the space needed."""

    def __init__(
        self, directory: str | os.PathLike[str], needed: int | None, *, at_least: bool = False
    ) -> None:
        free = free_bytes(directory)
        need = (
            f"this write needs {'at least ' if at_least else ''}{format_bytes(needed)}"
            if needed
            else "this write needs more space"
        )
        has = f" and {format_bytes(free)} is free" if free is not None else ""
        super().__init__(
            errno.ENOSPC,
            f"{directory}: no space left on the device: {need}{has}; free some space there or use another "
            "--run-dir",
        )
        self.directory = Path(directory)
        self.needed = needed

    def __str__(self) -> str:
        return str(self.strerror)


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it chains, says the disk or the quota is full."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _CODES:
            return True
        text = str(current).lower()
        if any(w in text for w in _WORDS) or (
            isinstance(current, RuntimeError) and _TORCH_SHORT_WRITE in text
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the file system of `path` (of its nearest existing parent), or None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the regular files under `path` (links not followed; 0 when it is gone)."""
    total = 0
    for parent, _, files in os.walk(path, followlinks=False):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


@contextlib.contextmanager
def naming_full_disk(
    directory: str | os.PathLike[str],
    needed: int | Callable[[], int] | None = None,
    *,
    at_least: bool = False,
) -> Iterator[None]:
    """Run the block; a full disk in it becomes one `DiskFullError` naming `directory` and `needed` bytes
    (a callable is asked only then, e.g. for what a directory write had written before it failed)."""
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as exc:
        if not is_disk_full(exc):
            raise
        size = needed() if callable(needed) else needed
        raise DiskFullError(directory, size, at_least=at_least) from None
