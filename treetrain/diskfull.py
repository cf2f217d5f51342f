"""A full disk, whatever wrote to it, is one `DiskFullError` line naming the directory and the space needed.

Every write of a run (checkpoints through torch's zip writer and safetensors, tree files, metrics, the
config, the summary) goes through `treetrain.io`'s atomic writes or an append, so a full disk never leaves a
half-written file; but each writer reports it in its own words. `os.write` raises `OSError(ENOSPC)`; torch's
checkpoint writer `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 930112 vs
930004`; safetensors `SafetensorError: ... No space left on device`. `is_disk_full` recognizes all of them
(and the causes they chain), and `naming_full_disk` turns them into one line:

    /runs/r/checkpoints: no space left on the device (the file system mounted at /runs): this write needs
    at least 4.3 MiB and 48.0 KiB is free; free some space there or use another --run-dir

The line names the place that was full and advises for it: `free some space there` by default; a command
that knows the place is its own output adds its way out (`treetrain train`: `or use another --run-dir`, only
for a place inside the run directory); POSIX shared memory (`/dev/shm`, where processes share tensors, as
the asynchronous `hf` sampler shares the policy's weights) is advised to be made larger. A failure whose
exception names no file is placed by `full_place` (an `OSError`'s file name, or torch's shared-memory
object `</torch_...>`), never guessed.

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
    treetrain.diskfull.DiskFullError: /tmp: no space left on the device...: this write needs 2.0 KiB and ... is free; ...
    >>> full_place(RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left on device (28)"))
    PosixPath('/dev/shm')
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from treetrain.bytesize import format_bytes
from treetrain.errors import TreetrainError

_CODES = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_WORDS = ("no space left on device", "disk quota exceeded")
_TORCH_SHORT_WRITE = "unexpected pos"
"""What torch's zip writer (`inline_container.cc`) says when a write came up short: the disk filled."""
SHARED_MEMORY = Path("/dev/shm")
"""Where Linux keeps POSIX shared-memory objects (`shm_open`), which torch shares tensors between processes in."""
_SHM_OBJECT = re.compile(r"<(/[^/<>\s]+)>")
"""A shared-memory object's name in torch's messages (`... for file </torch_123_456_0>: No space left ...`)."""
SHARED_MEMORY_REMEDY = (
    f"{SHARED_MEMORY} is the POSIX shared memory processes share tensors in (the asynchronous hf sampler "
    "shares the policy's weights there): make it larger (docker run --shm-size=2g, or mount -o "
    f"remount,size=2G {SHARED_MEMORY}) or free some space there"
)


class DiskFullError(TreetrainError, OSError):
    """A write found the disk (or the quota) full; the message names the directory, the file system it is
    on, the space needed, and what to do (`remedy`; by default what fits the place, see the module)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        needed: int | None,
        *,
        at_least: bool = False,
        remedy: str | None = None,
    ) -> None:
        free = free_bytes(directory)
        need = (
            f"this write needs {'at least ' if at_least else ''}{format_bytes(needed)}"
            if needed
            else "this write needs more space"
        )
        has = f" and {format_bytes(free)} is free" if free is not None else ""
        mount = mount_point(directory)
        shown = mount is not None and mount != Path(os.path.abspath(directory))
        on = f" (the file system mounted at {mount})" if shown else ""
        self.directory = Path(directory)
        self.needed, self.at_least = needed, at_least
        self.remedy = remedy or default_remedy(directory)
        super().__init__(
            errno.ENOSPC, f"{directory}: no space left on the device{on}: {need}{has}; {self.remedy}"
        )

    def __str__(self) -> str:
        return str(self.strerror)

    def with_remedy(self, remedy: str) -> DiskFullError:
        """The same error advising `remedy` instead (a caller that knows the place is its own output)."""
        again = DiskFullError(self.directory, self.needed, at_least=self.at_least, remedy=remedy)
        for note in getattr(self, "__notes__", []):
            again.add_note(note)
        return again


class UnplacedDiskFullError(DiskFullError):
    """A disk-full error that names no file (`full_place` found none): said as such, with the free space of
    the command's output directory for comparison, never as if that directory were the one that was full."""

    def __init__(self, exc: BaseException, near: str | os.PathLike[str]) -> None:
        free = free_bytes(near)
        has = f"{format_bytes(free)} is free in {near}" if free is not None else f"{near} cannot be measured"
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        OSError.__init__(
            self,
            errno.ENOSPC,
            f"no space left on a device, and the error names no file ({text}); {has}, so if that is plenty "
            "another file system is full (the temporary directory, or /dev/shm for shared memory): free some "
            "space there",
        )
        self.directory, self.needed, self.at_least, self.remedy = Path(near), None, False, "free some space"


def as_disk_full(exc: BaseException, output: str | os.PathLike[str], remedy: str) -> DiskFullError:
    """A disk-full `exc` as the one `DiskFullError` a command reports: the place it names (`full_place`, or
    `UnplacedDiskFullError` when none), and `remedy` added to the advice when that place lies inside the
    command's own `output` directory (`treetrain train`: `use another --run-dir`)."""
    if isinstance(exc, DiskFullError):
        full = exc
    else:
        place = full_place(exc)
        full = DiskFullError(place, None) if place is not None else UnplacedDiskFullError(exc, output)
        for note in getattr(exc, "__notes__", []):
            full.add_note(note)
    if isinstance(full, UnplacedDiskFullError):
        return full
    inside = Path(os.path.abspath(full.directory))
    mine = Path(os.path.abspath(output))
    if inside == mine or mine in inside.parents:
        return full.with_remedy(f"{full.remedy} or {remedy}")
    return full


def on_shared_memory(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is in POSIX shared memory (`/dev/shm`)."""
    absolute = Path(os.path.abspath(path))
    return absolute == SHARED_MEMORY or SHARED_MEMORY in absolute.parents


def default_remedy(path: str | os.PathLike[str]) -> str:
    """What to do about a full `path`, when the caller knows nothing more of it."""
    return SHARED_MEMORY_REMEDY if on_shared_memory(path) else "free some space there"


def mount_point(path: str | os.PathLike[str]) -> Path | None:
    """The mount point of the file system `path` (or its nearest existing parent) is on; None if unknown."""
    p = Path(os.path.abspath(path))
    try:
        while not p.exists() and p != p.parent:
            p = p.parent
        while not os.path.ismount(p) and p != p.parent:
            p = p.parent
    except OSError:
        return None
    return p


def full_place(exc: BaseException) -> Path | None:
    """The directory a disk-full `exc` (or an exception it chains) names: an `OSError`'s file's directory,
    or shared memory for a shared-memory object torch names; None when it names no place."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        filename = getattr(current, "filename", None) if isinstance(current, OSError) else None
        if isinstance(filename, str | os.PathLike) and os.fspath(filename):
            name = Path(os.fspath(filename))
            return name if name.is_dir() else name.parent
        if _SHM_OBJECT.search(str(current)) and "shm" in str(current).lower():
            return SHARED_MEMORY
        current = current.__cause__ or current.__context__
    return None


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
    remedy: str | None = None,
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
        raise DiskFullError(directory, size, at_least=at_least, remedy=remedy) from None
