"""Atomic writes: readers see the old file (or directory) or the new one, never a partial one.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> atomic_write_bytes(d / "a.bin", b"hello")
    >>> with atomic_directory(d / "ckpt") as tmp:
    ...     _ = (tmp / "weights.txt").write_text("w")
    >>> sorted(p.name for p in d.iterdir())
    ['a.bin', 'ckpt']
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


def _fsync_dir(directory: str) -> None:
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory, fsync, then rename."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_directory(
    final: str | os.PathLike[str],
    *,
    token: str | None = None,
    writer: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Iterator[Path]:
    """Yield a temporary sibling of `final` to fill; move it into place when the block ends.

    An existing `final` is moved aside first and deleted only after the swap, so at every moment `final` is
    the complete old directory or the complete new one. On an error the temporary is removed and `final` is
    untouched. With several ranks, pass the same `token` on every rank (so they share the temporary
    directory), a `barrier`, and `writer=True` on exactly one rank: that rank creates, swaps and cleans up.
    """
    final = Path(final).absolute()
    token = token or uuid.uuid4().hex[:12]
    tmp = final.parent / f".{final.name}.tmp-{token}"
    old = final.parent / f".{final.name}.old-{token}"
    if writer:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    try:
        yield tmp
        barrier()
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if writer:
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(str(final.parent))
        shutil.rmtree(old, ignore_errors=True)
    barrier()
