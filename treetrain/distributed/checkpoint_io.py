"""Checkpoint plumbing shared by the backends: the caller's client state, and atomic directories.

The client state is whatever the trainer needs to resume besides weights and optimizer state (update
index, model version, RNG states): a JSON object, stored as JSON next to the weights, never pickled.

Checkpoints are written with `treetrain.io.atomic_directory`: every rank writes into one temporary sibling
directory, and only once all have finished does one rank move it into place. A reader therefore sees the
previous checkpoint or the new one, never a half-written mix.

Example:
    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> from treetrain.io import atomic_directory
    >>> with atomic_directory(root / "ckpt") as tmp:
    ...     write_client_state(tmp, {"version": 3})
    >>> sorted(p.name for p in root.iterdir()), read_client_state(root / "ckpt")
    (['ckpt'], {'version': 3})
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from treetrain.errors import TreetrainError
from treetrain.jsonfile import read_json_object

STATE_FILE = "client_state.json"
SCHEMA = "treetrain.client_state/1"
MAX_STATE_BYTES = 16 << 20


class CheckpointError(TreetrainError, RuntimeError):
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
    data = read_json_object(path, max_bytes=MAX_STATE_BYTES, error=CheckpointError)
    if data.get("schema") != SCHEMA:
        raise CheckpointError(f"{path}: field 'schema' must be {SCHEMA!r}, found {data.get('schema')!r:.60}")
    state = data.get("client_state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: field 'client_state' must be an object")
    return state
