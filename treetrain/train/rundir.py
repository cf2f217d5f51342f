"""The run directory: which files treetrain owns there, the lock that keeps one process in it, and clean-up.

A run directory holds a marker file (`.treetrain-run`) written before anything else. Only a directory with
the marker, or a new or empty one, is ever written to, and `--overwrite` deletes only the entries a run
writes (`config.yaml`, `metrics.jsonl`, `checkpoints/update-NNNNN`, `final`, ...), never anything else: a
user's `checkpoints/my-model.pt` survives. While a run or a resume is active it holds an exclusive
`fcntl.flock` on `.treetrain-lock`; the kernel drops that lock when the process dies, even by `kill -9`, so a
crashed run never leaves the directory stuck, and a second process on the same directory is refused. Every
entry treetrain owns there must be a regular file or a real directory (`check_layout`, `treetrain.runfs`):
a planted link or special file is refused before anything is written, never followed.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "run"
    >>> lock = claim_run_dir(d, resume=False, overwrite=False)
    >>> claim_run_dir(d, resume=True, overwrite=False)
    Traceback (most recent call last):
    treetrain.train.rundir.RunDirError: ... is in use by another treetrain process (pid ...); wait for it to end or use another --run-dir
    >>> lock.release()
    >>> sorted(p.name for p in d.iterdir())
    ['.treetrain-lock', '.treetrain-run']
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from treetrain.errors import TreetrainError
from treetrain.io import atomic_write_text, recover_atomic_leftovers
from treetrain.rollout.sources.env_failures import ENV_ERRORS
from treetrain.runfs import UnsafePathError, entry_kind, expect, refuse, remove_file, remove_tree

log = logging.getLogger(__name__)

MARKER = ".treetrain-run"
"""Written into every run directory before anything else: what `--overwrite` and `--resume` look for."""
LOCK = ".treetrain-lock"
"""Held with `fcntl.flock` by the one process training in the directory."""
MARKER_SCHEMA = "treetrain.run/1"

OWN_FILES = ("config.yaml", "metrics.jsonl", "summary.txt", "reward.png")
OWN_DIRS = ("final", "final-merged", "tensorboard", "engine-weights")
"""`engine-weights/` holds the weights the rollout hands an inference server; rewritten at every sync, so
`--overwrite` and a run that never started remove it like the others."""
OWN_PARENTS = ("checkpoints", "rollouts", "eval")
"""Directories holding one `update-NNNNN` directory per checkpoint, per update's rollouts, or per held-out
evaluation (`eval/update-NNNNN/`: after NNNNN updates)."""
_UPDATE_DIR = re.compile(r"update-\d{5,}")
_ENV_LOG = re.compile(r"update-\d{5,}(-rank\d+)?\.log")


class RunDirError(TreetrainError, RuntimeError):
    """The run directory cannot be used as asked; the message names it and what to do."""


@dataclass
class RunLock:
    """An exclusive lock on a run directory, held until `release()` (or until the process ends)."""

    path: Path
    fd: int | None
    created: bool = False
    """Whether claiming created the run directory itself (an abandoned run then removes it again)."""
    fresh: bool = False
    """A fresh run in a new or empty directory: if it never completes an update, it leaves nothing behind."""

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.release()


def is_run_dir(run_dir: Path) -> bool:
    """Whether `run_dir` holds the marker as a regular file of its own (a link to one does not count)."""
    return entry_kind(run_dir / MARKER) == "file"


def _entries(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []


def check_layout(run_dir: Path) -> None:
    """Refuse a run directory where an entry treetrain writes, reads back or deletes is a link, a special
    file, or the wrong kind, before anything is written; every file below its own directories is checked too.
    """
    for name in (MARKER, LOCK, *OWN_FILES):
        expect(run_dir / name, "file")
    for name in (*OWN_DIRS, *OWN_PARENTS, ENV_ERRORS):
        if expect(run_dir / name, "dir") == "dir":
            _check_below(run_dir / name)
    for name in OWN_PARENTS:
        if entry_kind(run_dir / name) == "dir":
            for path in (run_dir / name).iterdir():
                if _UPDATE_DIR.fullmatch(path.name):
                    expect(path, "dir")
                    expect(path / "trees", "dir")


def _check_below(directory: Path) -> None:
    """Everything below `directory` is a regular file or a real directory (walked without following links)."""
    for parent, dirs, files in os.walk(directory, followlinks=False, onerror=_raise):
        for name in dirs + files:
            kind = entry_kind(Path(parent) / name)
            if kind not in ("file", "dir"):
                raise refuse(Path(parent) / name, kind)


def _raise(exc: OSError) -> None:
    raise UnsafePathError(f"{exc.filename}: cannot list it: {exc.strerror}")


def _lock(run_dir: Path) -> RunLock:
    path = run_dir / LOCK
    flags = (
        os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refuse(path, "symlink") from None
        raise RunDirError(f"{path}: cannot open the run lock: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise refuse(path, "dir" if stat.S_ISDIR(mode) else "special")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(
            f"{run_dir} is in use by another treetrain process (pid {holder}); wait for it to end or use "
            "another --run-dir"
        ) from None
    except OSError as exc:  # a file system without flock (some NFS or FUSE mounts)
        os.close(fd)
        raise RunDirError(
            f"{path}: this file system does not support the run lock (flock: {exc.strerror}); use a --run-dir "
            "on a local or lock-capable file system"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return RunLock(path, fd)


def claim_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> RunLock:
    """Check that this run may use `run_dir`, mark it, and lock it (one process: rank 0).

    A fresh run needs a new or empty directory, or a treetrain run with `overwrite` (whose own entries the
    caller removes later with `remove_run_artifacts`). `resume` needs a treetrain run. Every entry treetrain
    owns is checked first (`check_layout`): a link or a special file among them is refused before anything is
    written. Leftovers of writes cut short by a crash are cleaned up once the lock is held.
    """
    try:  # a name too long, a symlink loop, a directory that cannot be listed
        existed = os.path.lexists(run_dir)
        not_a_dir = existed and not run_dir.is_dir()
        if existed and not not_a_dir:
            expect(run_dir / MARKER, "file")
            expect(run_dir / LOCK, "file")
        foreign = [] if not_a_dir else [name for name in _entries(run_dir) if name not in (MARKER, LOCK)]
        ours = is_run_dir(run_dir)
        if ours:
            check_layout(run_dir)
    except OSError as exc:
        raise RunDirError(f"--run-dir {run_dir}: cannot use it: {exc.strerror or exc}") from None
    if not_a_dir:
        raise RunDirError(f"{run_dir} exists and is not a directory; use another --run-dir")
    if not ours:
        if resume:
            raise RunDirError(f"--resume: {run_dir} holds no treetrain run (no {MARKER} marker there)")
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise RunDirError(
                f"{run_dir} is not empty ({shown}) and is not a treetrain run directory (no {MARKER} marker); "
                "treetrain writes only into a new or empty directory or one of its own runs, and never "
                "deletes files it did not write: use another --run-dir"
            )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"--run-dir {run_dir}: cannot create it: {exc.strerror}") from None
    if not is_run_dir(run_dir):
        atomic_write_text(run_dir / MARKER, json.dumps({"schema": MARKER_SCHEMA}) + "\n")
    lock = _lock(run_dir)
    lock.created = not existed
    try:
        found = [name for name in _entries(run_dir) if name not in (MARKER, LOCK)]
        if not resume and _unstarted(run_dir, found):  # a run that never started: its tracebacks go now
            remove_run_artifacts(run_dir)
            found = []
        lock.fresh = not resume and not found
        if not resume and not overwrite and found:
            raise RunDirError(
                f"{run_dir} already holds a run ({', '.join(found[:5])}); use --resume to continue it, "
                "--overwrite to replace it, or another --run-dir"
            )
        clean_leftovers(run_dir)
    except BaseException:
        lock.release()
        raise
    return lock


def _unstarted(run_dir: Path, found: list[str]) -> bool:
    """Whether all that is in `run_dir` besides the marker and the lock is what a run that never started
    keeps (`abandon_run_dir(..., keep_env_errors=True)`): `env-errors/` holding only its own logs."""
    if found != [ENV_ERRORS] or entry_kind(run_dir / ENV_ERRORS) != "dir":
        return False
    return all(
        _ENV_LOG.fullmatch(p.name) and entry_kind(p) == "file" for p in (run_dir / ENV_ERRORS).iterdir()
    )


def clean_leftovers(run_dir: Path) -> None:
    """Remove what writes cut short left behind (temporary checkpoint, export and file copies)."""
    removed = recover_atomic_leftovers(run_dir)
    subs = (
        "checkpoints",
        "engine-weights",
        *(f"rollouts/{p.name}" for p in _update_dirs(run_dir / "rollouts")),
    )
    for sub in subs:
        if entry_kind(run_dir / sub) == "dir":
            removed += recover_atomic_leftovers(run_dir / sub)
    if removed:
        log.info(
            "removed %d leftover(s) of interrupted writes: %s", len(removed), ", ".join(map(str, removed))
        )


def _update_dirs(parent: Path) -> list[Path]:
    if entry_kind(parent) != "dir":
        return []
    return [p for p in parent.iterdir() if entry_kind(p) == "dir" and _UPDATE_DIR.fullmatch(p.name)]


def remove_run_artifacts(run_dir: Path, *, keep_env_errors: bool = False) -> None:
    """Delete what an earlier run in `run_dir` wrote, and nothing else (the lock must be held); with
    `keep_env_errors`, its environment tracebacks (`env-errors/`) stay.

    Nothing is followed: a link or a special file where treetrain keeps one of its entries is refused.
    """
    check_layout(run_dir)
    clean_leftovers(run_dir)
    for name in OWN_FILES:
        remove_file(run_dir, run_dir / name)
    for name in OWN_DIRS:
        remove_tree(run_dir, run_dir / name)
    for name in OWN_PARENTS:
        parent = run_dir / name
        for path in _update_dirs(parent):
            remove_tree(run_dir, path)
        with contextlib.suppress(OSError):  # kept when it holds anything else
            parent.rmdir()
    logs = run_dir / ENV_ERRORS
    if entry_kind(logs) == "dir" and not keep_env_errors:
        for path in logs.iterdir():
            if _ENV_LOG.fullmatch(path.name):
                remove_file(run_dir, path)
        with contextlib.suppress(OSError):  # kept when it holds anything else
            logs.rmdir()


def abandon_run_dir(run_dir: Path, lock: RunLock, *, keep_env_errors: bool = False) -> str:
    """Undo a fresh run that never completed an update: its entries, the marker, the lock, and the directory
    when claiming created it. Returns what was done, for the one-line refusal.

    With `keep_env_errors` (the run was stopped by its environment, and the refusal names a traceback file
    in `env-errors/`), that directory and the marker stay and nothing else does: the next fresh run there
    takes the directory as new, without `--overwrite`, and removes those tracebacks (`claim_run_dir`)."""
    if keep_env_errors and entry_kind(run_dir / ENV_ERRORS) == "dir":
        remove_run_artifacts(run_dir, keep_env_errors=True)
        remove_file(run_dir, run_dir / LOCK)
        lock.release()
        return f"the run never started; {run_dir} keeps only {ENV_ERRORS}/, and a new run there needs no --overwrite"
    remove_run_artifacts(run_dir)
    remove_file(run_dir, run_dir / MARKER)
    remove_file(run_dir, run_dir / LOCK)
    lock.release()
    if lock.created:
        with contextlib.suppress(OSError):
            run_dir.rmdir()
            return f"the run never started; {run_dir} was removed again"
    return f"the run never started; nothing of it was left in {run_dir}"
