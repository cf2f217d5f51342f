"""Resumable run checkpoints: the backend's model and optimizer state plus the trainer's own counters and RNGs.

Checkpoints live in `<run_dir>/checkpoints/update-XXXXX/`, each written atomically by the backend; the
trainer state (update index, model version, RNG states) travels as the backend's client state. Resuming
restores all of it, so the next update samples the same tasks with the same seeds and the same weights.
"""

from __future__ import annotations

import logging
import pickle
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from treetrain.distributed.backend import TrainBackend
from treetrain.distributed.checkpoint_io import CheckpointError
from treetrain.runfs import expect, make_dirs

log = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"update-\d{5,}")


@dataclass(frozen=True)
class TrainerState:
    """Counters that must survive a restart."""

    update: int
    """Updates completed (the next update's index)."""
    version: int
    """Model version: optimizer steps taken."""


def _rng_state() -> dict[str, Any]:
    """RNG states as plain JSON values (checkpoints never need unpickling to resume)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def checkpoint_dir(run_dir: Path, update: int) -> Path:
    return run_dir / "checkpoints" / f"update-{update:05d}"


def checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories in `run_dir`, oldest first (temporary ones, `.update-*.tmp-*`, never)."""
    root = run_dir / "checkpoints"
    if expect(root, "dir") != "dir":  # a link there is refused, never listed
        return []
    return sorted(
        p for p in root.iterdir() if CHECKPOINT_NAME.fullmatch(p.name) and expect(p, "dir") == "dir"
    )


def save_trainer_state(
    backend: TrainBackend, run_dir: Path, state: TrainerState, config: Mapping[str, Any] | None = None
) -> Path:
    """A checkpoint of `state`; `config` (the run's settings as `to_dict` gives them) goes into its client
    state, so that a resume can tell an edited `config.yaml` (`treetrain.train.resume.saved_config`)."""
    path = checkpoint_dir(run_dir, state.update)
    if backend.rank == 0:
        make_dirs(run_dir, path.parent)  # `checkpoints/` as a link to elsewhere is refused
    client: dict[str, Any] = {"update": state.update, "version": state.version, "rng": _rng_state()}
    if config is not None:
        client["config"] = dict(config)
    backend.save_checkpoint(path, client)
    return path


def load_trainer_state(backend: TrainBackend, path: Path) -> TrainerState:
    client = backend.load_checkpoint(path)
    try:
        state = TrainerState(update=int(client["update"]), version=int(client["version"]))
        _set_rng_state(client["rng"])
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path}: the trainer state in it is malformed ({type(exc).__name__}: {exc})"
        ) from None
    return state


UNREADABLE = (
    CheckpointError,
    SafetensorError,
    OSError,
    EOFError,
    RuntimeError,
    ValueError,
    pickle.UnpicklingError,
)
"""What reading a torn or corrupt checkpoint raises (weights-only unpickling refuses anything else)."""


def resume_state(backend: TrainBackend, run_dir: Path) -> tuple[TrainerState, Path] | None:
    """Load the newest checkpoint that reads completely, falling back past torn ones and saying so.

    None when the run has no checkpoint yet; `CheckpointError` (one line, naming each) when none reads.
    """
    failures: list[str] = []
    for path in reversed(checkpoints(run_dir)):
        try:
            state = load_trainer_state(backend, path)
        except UNREADABLE as exc:
            reason = " ".join(str(exc).split())[:300]
            log.warning("checkpoint %s cannot be read (%s); trying the one before it", path, reason)
            failures.append(f"{path.name}: {reason}")
            continue
        if failures:
            log.warning("resuming from %s, the newest checkpoint that reads completely", path)
        return state, path
    if failures:
        raise CheckpointError(
            f"no checkpoint under {run_dir / 'checkpoints'} reads completely: {'; '.join(failures)}"
        )
    return None
