"""The run directory: which files treetrain owns there, the lock that keeps one process in it, and clean-up.

A run directory holds a marker file (`.treetrain-run`) written before anything else. Only a directory with
the marker, or a new or empty one, is ever written to, and `--overwrite` deletes only the entries a run
writes (`config.yaml`, `metrics.jsonl`, `checkpoints/update-NNNNN`, `final`, ...), never anything else: a
user's `checkpoints/my-model.pt` survives. While a run or a resume is active it holds an exclusive
`fcntl.flock` on `.treetrain-lock`; the kernel drops that lock when the process dies, even by `kill -9`, so a
crashed run never leaves the directory stuck, and a second process on the same directory is refused.

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
import fcntl
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from treetrain.io import atomic_write_text, recover_atomic_leftovers

log = logging.getLogger(__name__)

MARKER = ".treetrain-run"
"""Written into every run directory before anything else: what `--overwrite` and `--resume` look for."""
LOCK = ".treetrain-lock"
"""Held with `fcntl.flock` by the one process training in the directory."""
MARKER_SCHEMA = "treetrain.run/1"

OWN_FILES = ("config.yaml", "metrics.jsonl", "summary.txt", "reward.png")
OWN_DIRS = ("final", "final-merged", "tensorboard")
_UPDATE_DIR = re.compile(r"update-\d{5,}")
_ENV_LOG = re.compile(r"update-\d{5,}(-rank\d+)?\.log")
_PLOT_TMP = ".reward.png.tmp.png"


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; the message names it and what to do."""


@dataclass
class RunLock:
    """An exclusive lock on a run directory, held until `release()` (or until the process ends)."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.release()


def is_run_dir(run_dir: Path) -> bool:
    return (run_dir / MARKER).is_file()


def _entries(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []


def _lock(run_dir: Path) -> RunLock:
    path = run_dir / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunDirError(f"{path}: cannot open the run lock: {exc.strerror}") from None
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
    caller removes later with `remove_run_artifacts`). `resume` needs a treetrain run. Leftovers of writes
    cut short by a crash are cleaned up once the lock is held.
    """
    try:  # a name too long, a symlink loop, a directory that cannot be listed
        not_a_dir = run_dir.exists() and not run_dir.is_dir()
        foreign = [] if not_a_dir else [name for name in _entries(run_dir) if name not in (MARKER, LOCK)]
        ours = is_run_dir(run_dir)
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
    try:
        if not resume and not overwrite:
            found = [name for name in _entries(run_dir) if name not in (MARKER, LOCK)]
            if found:
                raise RunDirError(
                    f"{run_dir} already holds a run ({', '.join(found[:5])}); use --resume to continue it, "
                    "--overwrite to replace it, or another --run-dir"
                )
        clean_leftovers(run_dir)
    except BaseException:
        lock.release()
        raise
    return lock


def clean_leftovers(run_dir: Path) -> None:
    """Remove what writes cut short left behind (temporary checkpoint, export and file copies)."""
    removed = recover_atomic_leftovers(run_dir)
    for sub in ("checkpoints", *(f"rollouts/{p.name}" for p in _update_dirs(run_dir / "rollouts"))):
        if (run_dir / sub).is_dir():
            removed += recover_atomic_leftovers(run_dir / sub)
    plot = run_dir / _PLOT_TMP
    if plot.is_file():
        plot.unlink()
        removed.append(plot)
    if removed:
        log.info(
            "removed %d leftover(s) of interrupted writes: %s", len(removed), ", ".join(map(str, removed))
        )


def _update_dirs(parent: Path) -> list[Path]:
    if not parent.is_dir():
        return []
    return [
        p for p in parent.iterdir() if p.is_dir() and not p.is_symlink() and _UPDATE_DIR.fullmatch(p.name)
    ]


def remove_run_artifacts(run_dir: Path) -> None:
    """Delete what an earlier run in `run_dir` wrote, and nothing else (the lock must be held)."""
    clean_leftovers(run_dir)
    for name in OWN_FILES:
        path = run_dir / name
        if path.is_file() or path.is_symlink():
            path.unlink()
    for name in OWN_DIRS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
    for name in ("checkpoints", "rollouts"):
        parent = run_dir / name
        for path in _update_dirs(parent):
            shutil.rmtree(path)
        with contextlib.suppress(OSError):  # kept when it holds anything else
            parent.rmdir()
    logs = run_dir / "env-errors"  # environment tracebacks (treetrain.train.env_failures)
    if logs.is_dir() and not logs.is_symlink():
        for path in logs.iterdir():
            if path.is_file() and _ENV_LOG.fullmatch(path.name):
                path.unlink()
        with contextlib.suppress(OSError):
            logs.rmdir()
