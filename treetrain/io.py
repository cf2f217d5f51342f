"""Atomic writes: readers see the old file (or directory) or the new one, never a partial one; and the one
way untrusted input files are opened (`open_regular`).

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
import errno
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Literal

from treetrain.diskfull import DiskFullError, is_disk_full, naming_full_disk, tree_bytes


def _fsync_dir(directory: str) -> None:
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _kind(mode: int) -> str:
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"


def output_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `atomic_write_bytes(path, ...)` would be refused, or None: checked before any work, so a verb
    does not print its result and then fail to write it.

    Example:
        >>> output_problem("/no/such/dir/out.dot")
        "'/no/such/dir' does not exist"
        >>> output_problem("/")
        "'/': a directory; refusing to replace it"
    """
    name = os.fspath(path)
    if os.path.exists(name) and not stat.S_ISREG(mode := os.stat(name).st_mode):
        return f"{name!r}: {_kind(mode)}; refusing to replace it"
    return path_problem(os.path.dirname(name) or ".", "directory")


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory, fsync, then rename.

    Only a regular file (or nothing) is replaced: renaming over `/dev/null`, a FIFO or a socket would put a
    file where a device was, and a symbolic link is someone else's pointer, so those raise `OSError`
    naming the path.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    existing = os.lstat(path) if os.path.lexists(path) else None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        raise OSError(errno.EINVAL, f"{_kind(existing.st_mode)}; refusing to replace it", path)
    mode = existing.st_mode & 0o777 if existing is not None else 0o644
    with naming_full_disk(directory, len(data)):  # one line naming the directory, whatever the disk said
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


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open an untrusted input file for reading, refusing anything but a regular file.

    A FIFO would block `open` forever and a device such as /dev/zero never ends, so the file is opened
    non-blocking and its type checked before a byte is read. Raises `OSError` naming the path.

    Example:
        >>> open_regular("/dev/zero")
        Traceback (most recent call last):
        OSError: [Errno 22] not a regular file (a FIFO, device or socket): '/dev/zero'
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket)", os.fspath(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def path_problem(path: str | os.PathLike[str], want: Literal["file", "directory"]) -> str | None:
    """What is wrong with an input path given on the command line or in a config, or None.

    One wording for every verb, so that a missing path, a directory given for a file (or the other way
    round) and a FIFO read the same everywhere, and before any library is asked to open it (Hugging Face
    takes a missing directory for a hub repository id).

    Example:
        >>> path_problem("/no/such/dir", "directory")
        "'/no/such/dir' does not exist"
        >>> path_problem("/", "file")
        "'/' is a directory, not a file"
    """
    name = os.fspath(path)
    if not name:
        return "an empty path names nothing"
    try:
        mode = os.stat(name).st_mode
    except FileNotFoundError:
        return f"{name!r} does not exist"
    except NotADirectoryError:
        return f"{name!r} does not exist (a part of it is a file)"
    except (OSError, ValueError) as e:
        return f"{name!r} cannot be read: {getattr(e, 'strerror', None) or e}"
    if want == "file" and stat.S_ISDIR(mode):
        return f"{name!r} is a directory, not a file"
    if want == "directory" and not stat.S_ISDIR(mode):
        return f"{name!r} is a file, not a directory"
    if want == "file" and not stat.S_ISREG(mode):
        return f"{name!r} is not a regular file (a FIFO, device or socket)"
    if not os.access(name, os.R_OK | (os.X_OK if want == "directory" else 0)):
        return f"{name!r} cannot be read: permission denied"
    return None


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
    if os.path.islink(final) or (os.path.lexists(final) and not final.is_dir()):
        kind = "a symbolic link" if os.path.islink(final) else "not a directory"
        raise OSError(errno.EINVAL, f"{kind}; refusing to replace it", str(final))
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
    except BaseException as exc:
        full = writer and is_disk_full(exc) and not isinstance(exc, DiskFullError)
        needed = _needed_for(final, tmp) if full else 0
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:  # torch's zip writer, safetensors and os.write each say it in their own words
            raise DiskFullError(final.parent, needed, at_least=True) from None
        raise
    if writer:
        if os.path.lexists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(str(final.parent))
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def _needed_for(final: Path, tmp: Path) -> int:
    """What a directory write that filled the disk needs, at least: what it wrote before it failed, or the
    size of the directory it replaces or of the newest one beside it (the previous checkpoint), if larger."""
    siblings = sorted(p for p in final.parent.iterdir() if p.is_dir() and not p.name.startswith("."))
    return max([tree_bytes(tmp), *(tree_bytes(p) for p in {final, *siblings[-1:]} if p.is_dir())])


def write_files_all_or_nothing(files: Sequence[tuple[Path, bytes]]) -> None:
    """Write every `(path, data)`, or, when anything fails part-way, leave the disk exactly as it was.

    Each new content is first written to a temporary sibling and fsynced; each file about to be
    overwritten is kept under a hard link (a copy where links are not supported); only then are the
    temporaries renamed into place. On any error the renamed files are put back from their keepers, files
    that did not exist are removed, and directories this call created are removed again.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()) / "out"
        >>> write_files_all_or_nothing([(d / "a.txt", b"a"), (d / "b.txt", b"b")])
        >>> sorted(p.name for p in d.iterdir())
        ['a.txt', 'b.txt']
    """
    created: list[Path] = []
    staged: list[tuple[Path, Path]] = []  # (temporary, target)
    kept: dict[Path, Path] = {}  # target -> the old content's keeper
    placed: list[Path] = []
    try:
        for target, data in files:
            target = Path(target).absolute()
            _make_parents(target.parent, created)
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            staged.append((Path(name), target))
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(name, os.stat(target).st_mode & 0o777 if target.exists() else 0o644)
        for _, target in staged:
            if target.exists() and target not in kept:
                keeper = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:12]}")
                try:
                    os.link(target, keeper)
                except OSError:
                    shutil.copy2(target, keeper)
                kept[target] = keeper
        for staged_file, target in staged:
            os.replace(staged_file, target)
            placed.append(target)
    except BaseException:
        for target in reversed(list(dict.fromkeys(placed))):
            with contextlib.suppress(OSError):
                if target in kept:
                    os.replace(kept.pop(target), target)
                else:
                    os.unlink(target)
        for leftover in [p for p, _ in staged] + list(kept.values()):
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    for keeper in kept.values():
        with contextlib.suppress(OSError):
            os.unlink(keeper)
    for directory in {target.parent for _, target in staged}:
        _fsync_dir(str(directory))


def _make_parents(directory: Path, created: list[Path]) -> None:
    """mkdir -p, recording (outermost first) every directory it created."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        d.mkdir()
        created.append(d)


_DIR_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9A-Za-z_]+")
_FILE_LEFTOVER = re.compile(r"\..+\.[0-9a-z_]{8}\.tmp")


def recover_atomic_leftovers(directory: str | os.PathLike[str]) -> list[Path]:
    """Undo what a killed `atomic_directory` or `atomic_write_bytes` left in `directory`; returns what it removed.

    Temporary copies are deleted. A directory moved aside (`.NAME.old-*`) whose replacement never arrived is
    moved back, so `NAME` is again the complete old directory; otherwise it is deleted. Only call this while
    no other process writes in `directory` (a run holds its lock).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> (d / ".ckpt.tmp-0123456789ab").mkdir(); (d / ".ckpt.old-0123456789ab").mkdir()
        >>> [p.name for p in recover_atomic_leftovers(d)], sorted(p.name for p in d.iterdir())
        (['.ckpt.tmp-0123456789ab'], ['ckpt'])
    """
    removed: list[Path] = []
    root = Path(directory)
    for path in sorted(root.iterdir()):
        found = _DIR_LEFTOVER.fullmatch(path.name)
        if found and path.is_dir() and not path.is_symlink():
            final = root / found["name"]
            if found["kind"] == "old" and not os.path.lexists(final):
                os.replace(path, final)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif _FILE_LEFTOVER.fullmatch(path.name) and (path.is_symlink() or path.is_file()):
            path.unlink()
            removed.append(path)
    if removed:
        _fsync_dir(str(root))
    return removed
