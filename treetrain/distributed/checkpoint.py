"""Checkpoint plumbing shared by the backends: the caller's client state, and atomic directories.

The client state is whatever the trainer needs to resume besides weights and optimizer state (update
index, model version, RNG states): a JSON object, stored as JSON next to the weights, never pickled.

`atomic_directory` makes a checkpoint appear whole or not at all: every rank writes into one temporary
sibling directory, and only once all have finished does one rank move it into place. A reader therefore
sees the previous checkpoint or the new one, never a half-written mix.

Example:
    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> with atomic_directory(root / "ckpt") as tmp:
    ...     write_client_state(tmp, {"version": 3})
    >>> sorted(p.name for p in root.iterdir()), read_client_state(root / "ckpt")
    (['ckpt'], {'version': 3})
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STATE_FILE = "client_state.json"
SCHEMA = "treetrain.client_state/1"
MAX_STATE_BYTES = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, malformed or from another schema; the message names the file and field."""


def write_client_state(directory: Path, state: Mapping[str, Any]) -> None:
    """Write `state` (JSON-serializable) into a checkpoint directory being built."""
    try:
        text = json.dumps({"schema": SCHEMA, "client_state": dict(state)})
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"client state is not JSON-serializable: {exc}") from exc
    with open(Path(directory) / STATE_FILE, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_client_state(directory: Path) -> dict[str, Any]:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no client state in this checkpoint directory")
    if path.stat().st_size > MAX_STATE_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_STATE_BYTES} bytes; not a client state file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{path}: field 'schema' must be {SCHEMA!r}, found {found!r}")
    state = data.get("client_state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: field 'client_state' must be an object")
    return state


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_directory(
    final: Path,
    *,
    token: str | None = None,
    writer: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Iterator[Path]:
    """Yield a temporary sibling of `final` to fill; move it into place when the block ends.

    With several ranks, pass the same `token` on every rank (so they share the temporary directory), a
    `barrier`, and `writer=True` on exactly one rank: that rank creates, swaps and cleans up. An existing
    `final` is moved aside first and deleted after the swap. On an error the temporary is removed and
    `final` is untouched.
    """
    final = Path(final)
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
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
