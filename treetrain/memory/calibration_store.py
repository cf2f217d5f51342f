"""Memory calibrations kept on disk, so that a run, its `--resume` and `treetrain plan` measure a model once.

A calibration replays dozens of probe trees on the real model (`treetrain.memory.calibrate`). That is
seconds on one process and a minute under ZeRO-3, where every forward's parameters are fetched from the
other ranks, and it is the same answer every time for the same model, dtype, device and code. So each one
is kept as a small JSON file, `<dir>/<key>.json`, named by the calibration's key, which covers everything
the measurement depends on: the model's configuration and trainable parameters, dtype, attention
implementation, device, contract, probes, the torch and transformers versions, and a digest of treetrain's own source (any change to the engine is a new key).

`<dir>` is `$TREETRAIN_CACHE_DIR`, else `$XDG_CACHE_HOME/treetrain/calibration`, else
`~/.cache/treetrain/calibration`; `TREETRAIN_CACHE_DIR=` (empty) turns the store off. The files are
written atomically; one that cannot be read back as a calibration of exactly its key (truncated,
edited, from another layout) is a miss, and is measured and written again. Nothing is unpickled.

Example:
    >>> import os, tempfile
    >>> from unittest import mock
    >>> from treetrain.memory.fit import Affine, MaxAffine
    >>> from treetrain.memory.memory_model import MemoryModel, RegimeModel
    >>> a = Affine((1.0, 2.5)); m = MaxAffine(a, a)
    >>> model = MemoryModel("0123abcd", "exact", 64, 32, RegimeModel(a, a, m, m), RegimeModel(a, a, m, m), 9, 0.01)
    >>> with mock.patch.dict(os.environ, {"TREETRAIN_CACHE_DIR": tempfile.mkdtemp()}):
    ...     save(model)
    ...     print(load("0123abcd") == model, load("fedcba98"))
    True None
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from treetrain.io import atomic_write_text
from treetrain.jsonfile import read_json_object
from treetrain.memory.fit import Affine, MaxAffine
from treetrain.memory.memory_model import MemoryModel, RegimeModel

log = logging.getLogger(__name__)

ENV = "TREETRAIN_CACHE_DIR"
MAX_FILE_BYTES = 1 << 20
"""A calibration file is a few kilobytes; anything larger is not one."""
_KEY = re.compile(r"[0-9a-f]{8,64}")


def store_dir() -> Path | None:
    """Where calibrations are kept, or None when the store is off (`TREETRAIN_CACHE_DIR=`)."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return Path(chosen).expanduser() if chosen.strip() else None
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:  # no home directory to be found (a bare container): no store
            return None
    return Path(base) / "treetrain" / "calibration"


@functools.cache
def code_digest() -> str:
    """A digest of treetrain's source files: a calibration measured by other code is not reused."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def load(key: str) -> MemoryModel | None:
    """The calibration stored under `key`, or None (no store, no file, or a file that is not exactly one)."""
    path = _path(key)
    if path is None or not path.is_file():
        return None
    try:
        model = _model(read_json_object(path, max_bytes=MAX_FILE_BYTES))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.info("memory calibration %s: %s; measuring again", path, str(exc).splitlines()[0])
        return None
    return model if model.key == key else None


def save(model: MemoryModel) -> None:
    """Keep `model` for later processes; a store that cannot be written is skipped (the run goes on)."""
    path = _path(model.key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(_plain(model), sort_keys=True))
    except OSError as exc:
        log.info("memory calibration not kept in %s: %s", path.parent, exc)


def _path(key: str) -> Path | None:
    where = store_dir()
    if where is None or not _KEY.fullmatch(key):
        return None
    return where / f"{key}.json"


def _plain(model: MemoryModel) -> dict[str, Any]:
    def regime(r: RegimeModel) -> dict[str, Any]:
        return {
            "graph": list(r.graph.coef),
            "forward": list(r.forward.coef),
            "backward": [list(r.backward.head.coef), list(r.backward.body.coef)],
            "nograd": [list(r.nograd.head.coef), list(r.nograd.body.coef)],
        }

    return {
        "key": model.key,
        "contract": model.contract,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "logit_rows": model.logit_rows,
        "past": regime(model.past),
        "root": regime(model.root),
        "samples": model.samples,
        "fit_error": model.fit_error,
        "head_grad_bytes": model.head_grad_bytes,
        "state_bytes_per_unit": model.state_bytes_per_unit,
        "recurrent_chunk": model.recurrent_chunk,
    }


def _model(d: dict[str, Any]) -> MemoryModel:
    def coef(x: Any) -> Affine:
        if not isinstance(x, list) or not all(
            isinstance(v, float | int) and not isinstance(v, bool) for v in x
        ):
            raise ValueError("a fitted cost is not a list of numbers")
        return Affine(tuple(float(v) for v in x))

    def pair(x: Any) -> MaxAffine:
        if not isinstance(x, list) or len(x) != 2:
            raise ValueError("a fitted peak is not two affine pieces")
        return MaxAffine(coef(x[0]), coef(x[1]))

    def regime(x: Any) -> RegimeModel:
        if not isinstance(x, dict):
            raise ValueError("a regime is not an object")
        return RegimeModel(coef(x["graph"]), coef(x["forward"]), pair(x["backward"]), pair(x["nograd"]))

    def integer(name: str, *, optional: bool = False) -> Any:
        v = d[name]
        if (v is None and optional) or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError(f"{name} is not a count")

    if d["contract"] not in ("exact", "response_only") or not isinstance(d["key"], str):
        raise ValueError("not a calibration")
    if not isinstance(d["fit_error"], float | int):
        raise ValueError("fit_error is not a number")
    return MemoryModel(
        d["key"],
        d["contract"],
        integer("kv_bytes_per_token"),
        integer("logit_rows"),
        regime(d["past"]),
        regime(d["root"]),
        integer("samples"),
        float(d["fit_error"]),
        integer("head_grad_bytes"),
        integer("state_bytes_per_unit"),
        integer("recurrent_chunk", optional=True),
    )
