"""Path primitives for a directory treetrain owns (a run directory): nothing here follows a symlink inside it.

A run directory is written, read back and cleaned up by treetrain, but a user (or another program) can plant
a symbolic link or a special file in it. Following a link would write a pid into the user's file, delete a
directory the link points at, or land rollouts outside the run; opening a FIFO would block forever. So every
entry below the root is looked at with `lstat`, files are opened with `O_NOFOLLOW | O_NONBLOCK` and their
type checked on the open descriptor, directories are created one component at a time, and trees are
removed with `shutil.rmtree`, which never descends a link. The root itself may be a link (a user's
`runs -> /scratch/runs`): only what lies below it is checked. Every refusal is an `UnsafePathError`, one line
naming the path and what is wrong with it.

Example:
    >>> import os, tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> os.symlink("/etc", root / "checkpoints")
    >>> make_dirs(root, root / "checkpoints" / "update-00001")
    Traceback (most recent call last):
    treetrain.runfs.UnsafePathError: .../checkpoints: a symbolic link; treetrain never follows a link inside its own directory (remove the link or use another --run-dir)
    >>> with open_file(root, root / "metrics.jsonl", "ab") as f:
    ...     _ = f.write(b"{}\\n")
    >>> entry_kind(root / "metrics.jsonl"), entry_kind(root / "checkpoints"), entry_kind(root / "nothing")
    ('file', 'symlink', 'missing')
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO, Literal

from treetrain.errors import TreetrainError

Kind = Literal["missing", "file", "dir", "symlink", "special"]

_MODES = {
    "rb": os.O_RDONLY,
    "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "wb": os.O_WRONLY | os.O_TRUNC | os.O_CREAT,
}
_FLAGS = getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_WHY = {
    "symlink": "a symbolic link; treetrain never follows a link inside its own directory (remove the link or "
    "use another --run-dir)",
    "special": "not a regular file or directory (a FIFO, device or socket); remove it or use another --run-dir",
    "dir": "a directory where treetrain keeps a file; remove it or use another --run-dir",
    "file": "a file where treetrain keeps a directory; remove it or use another --run-dir",
}


class UnsafePathError(TreetrainError, RuntimeError):
    """An entry of a treetrain-owned directory is a link, a special file, or the wrong kind; one line."""


def entry_kind(path: str | os.PathLike[str]) -> Kind:
    """What `path` itself is, never what a link at it points to."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "special"


def refuse(path: str | os.PathLike[str], kind: Kind) -> UnsafePathError:
    """The one-line error for an entry of the wrong `kind`."""
    return UnsafePathError(f"{os.fspath(path)}: {_WHY.get(kind, kind)}")


def expect(path: str | os.PathLike[str], want: Literal["file", "dir"]) -> Kind:
    """Raise unless `path` is missing or a real `want` (no link, no special file); returns what it is."""
    kind = entry_kind(path)
    if kind not in ("missing", want):
        raise refuse(path, kind)
    return kind


def _below(root: Path, path: Path) -> list[Path]:
    """The components of `path` below `root`, outermost first (`path` must lie inside `root`)."""
    try:
        rel = Path(os.path.abspath(path)).relative_to(os.path.abspath(root))
    except ValueError:
        raise UnsafePathError(f"{path}: not inside the run directory {root}") from None
    out, cur = [], Path(os.path.abspath(root))
    for part in rel.parts:
        cur = cur / part
        out.append(cur)
    return out


def check_parents(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Every directory between `root` and `path` is a real directory (or missing), never a link."""
    for component in _below(Path(root), Path(path))[:-1]:
        expect(component, "dir")


def make_dirs(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """`mkdir -p path` below `root`, refusing a component that is a link, a file or a special file (the
    root itself is created as `mkdir -p` would)."""
    os.makedirs(root, exist_ok=True)
    for component in _below(Path(root), Path(path)):
        if expect(component, "dir") == "missing":
            try:
                os.mkdir(component)
            except FileExistsError:  # made meanwhile: look again
                expect(component, "dir")
    return Path(path)


def open_file(
    root: str | os.PathLike[str] | None, path: str | os.PathLike[str], mode: Literal["rb", "ab", "wb"]
) -> BinaryIO:
    """Open a regular file below `root` (None: only `path` itself is checked) without following a link.

    A FIFO or device is refused on its open descriptor before a byte moves, so nothing can block. A file
    that does not exist (read) raises `FileNotFoundError` as `open` does.
    """
    p = Path(path)
    if root is not None:
        check_parents(root, p)
    try:
        fd = os.open(p, _MODES[mode] | _FLAGS, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or entry_kind(p) == "symlink":
            raise refuse(p, "symlink") from None
        if exc.errno == errno.EISDIR:
            raise refuse(p, "dir") from None
        if exc.errno == errno.ENOENT:
            raise
        raise UnsafePathError(f"{p}: cannot open it: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse(p, "dir" if stat.S_ISDIR(st.st_mode) else "special")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def read_bytes(root: str | os.PathLike[str] | None, path: str | os.PathLike[str], limit: int) -> bytes:
    """At most `limit + 1` bytes of a regular file (the caller refuses more), never through a link."""
    with open_file(root, path, "rb") as f:
        return f.read(limit + 1)


def remove_tree(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Delete a real directory below `root` and everything in it; links inside are removed, never followed."""
    check_parents(root, path)
    kind = entry_kind(path)
    if kind == "missing":
        return
    if kind != "dir":
        raise refuse(path, kind)
    assert shutil.rmtree.avoids_symlink_attacks, "this platform's rmtree could follow links"
    shutil.rmtree(path)


def remove_file(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Delete a regular file below `root`; a link, a directory or a special file there is refused."""
    check_parents(root, path)
    if expect(path, "file") == "file":
        os.unlink(path)
