"""Resumable run checkpoints: the backend's model and optimizer state plus the trainer's own counters and RNGs.

Checkpoints live in `<run_dir>/checkpoints/update-XXXXX/`, each written atomically by the backend; the
trainer state (update index, model version, RNG states) travels as the backend's client state. Resuming
restores all of it, so the next update samples the same tasks with the same seeds and the same weights.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from treetrain.distributed.backend import TrainBackend


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


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = run_dir / "checkpoints"
    found = (
        sorted(p for p in root.glob("update-*") if p.is_dir() and not p.name.startswith("."))
        if root.exists()
        else []
    )
    return found[-1] if found else None


def save_trainer_state(backend: TrainBackend, run_dir: Path, state: TrainerState) -> Path:
    path = checkpoint_dir(run_dir, state.update)
    backend.save_checkpoint(path, {"update": state.update, "version": state.version, "rng": _rng_state()})
    return path


def load_trainer_state(backend: TrainBackend, path: Path) -> TrainerState:
    client = backend.load_checkpoint(path)
    _set_rng_state(client["rng"])
    return TrainerState(update=int(client["update"]), version=int(client["version"]))
