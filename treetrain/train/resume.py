"""What `--resume` runs with: the run's own saved `config.yaml`, changed only where a change is safe.

A resumed run must be the same run: the same model, environment, loss, sampling and seed, or its later
updates would silently train something else against the earlier ones' checkpoints and metrics. So a resume
starts from the settings the run saved (`<run_dir>/config.yaml`), read as untrusted input like any config
file (`treetrain.train.config_file`: size, UTF-8, depth, alias and duplicate-key limits) and through
`treetrain.runfs` (never through a link, never a FIFO). `--config` and `--set` are then applied on top, and
the result may differ from the saved run only in `RESUMABLE`, settings that change how long the run goes,
how often it saves or measures, and how it uses this machine, never what an update computes. Any other
difference is refused in one line that names the key.

Example:
    >>> import tempfile, pathlib
    >>> from treetrain.train.config import dump_config, load_config
    >>> from treetrain.train.rundir import claim_run_dir
    >>> run = pathlib.Path(tempfile.mkdtemp()) / "run"
    >>> claim_run_dir(run, resume=False, overwrite=False).release()
    >>> _ = (run / "config.yaml").write_text(dump_config(load_config(None, ["updates=8", "rollout.groups_per_update=2"])))
    >>> cfg = resume_config(run, None, ["updates=12"])
    >>> cfg.updates, cfg.rollout.groups_per_update, cfg.run_dir == str(run)
    (12, 2, True)
    >>> resume_config(run, None, ["optim.lr=0.1"])
    Traceback (most recent call last):
    treetrain.errors.ConfigError: --resume: optim.lr is 3e-05 in the saved run (...config.yaml) and cannot change on resume (asked 0.1); only updates, checkpoint_every, checkpoint_every_s, measure_memory_every, threads, device, memory_budget, run_dir, eval.every, ... may; start a new run for other settings
"""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from treetrain.distributed.checkpoint_io import STATE_FILE, CheckpointError, read_client_state
from treetrain.errors import ConfigError
from treetrain.rollout.rollout_section import RESUMABLE_ROLLOUT
from treetrain.runfs import UnsafePathError, expect, read_bytes
from treetrain.train.config import TrainConfig, read_file
from treetrain.train.config_file import MAX_CONFIG_BYTES, parse_config_bytes
from treetrain.train.rundir import MARKER, RunDirError, is_run_dir
from treetrain.train.typed import apply_override, from_dict, to_dict

log = logging.getLogger(__name__)

SAVED_CONFIG = "config.yaml"
"""The run's settings, written by a fresh run before its first update (and by every resume)."""

CONFIG_KEY = "config"
"""The checkpoint's client state field holding the settings it was written under (`treetrain.train.typed.to_dict`)."""
_CHECKPOINT = re.compile(r"update-\d{5,}")

RESUMABLE = (
    "updates",
    "checkpoint_every",
    "checkpoint_every_s",
    "measure_memory_every",
    "threads",
    "device",
    "memory_budget",
    "run_dir",
    "eval.every",
    "eval.tasks",
    "eval.samples",
    "eval.greedy",
    "eval.pass_threshold",
    *(f"rollout.{key}" for key in RESUMABLE_ROLLOUT),
)
"""Settings a resume may change. `updates` extends or shortens the run; checkpoint and measurement cadence,
torch threads and the planner's memory budget change cost, not the update (the planner's choices are
exact under the `exact` contract, and are re-made every update anyway); `run_dir` is where the run is now;
`eval.*` changes what is measured on held-out tasks, never what an update computes (evaluation samples
with its own generators, tests/train/test_evaluation.py); `rollout.max_staleness` changes how far ahead the
sampler may run, and the trees an update takes are checked against the new bound (docs/async-training.md);
`device` is where one process trains (a checkpoint loads on any); the fleet's settings are the rollout's
(`RESUMABLE_ROLLOUT`)."""


def read_saved_config(run_dir: str | Path, flag: str = "--resume") -> dict[str, Any]:
    """The saved `config.yaml` of a run as a dict; a missing, linked, special or malformed one is refused,
    in a line that starts with `flag`, the option that led here (`--resume`, or `--model` for eval)."""
    path = Path(run_dir) / SAVED_CONFIG
    try:
        raw = read_bytes(run_dir, path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        advice = "; it cannot be resumed (start it again with --overwrite)" if flag == "--resume" else ""
        raise ConfigError(
            f"{flag}: {path} does not exist, so the run's settings (its model among them) are unknown{advice}"
        ) from None
    except UnsafePathError as exc:
        raise ConfigError(f"{flag}: the saved config: {exc}") from None
    try:
        return parse_config_bytes(raw, path.suffix, str(path))
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def saved_config(run_dir: str | Path, flag: str = "--resume") -> TrainConfig:
    """The run's saved settings, validated like any config, and held to the same rule as `--set`: they may
    differ from the settings the newest checkpoint was written under only in `RESUMABLE`. Errors start
    with `flag` (see `read_saved_config`)."""
    path = Path(run_dir) / SAVED_CONFIG
    try:
        saved = from_dict(TrainConfig, read_saved_config(run_dir, flag))
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(flag) else f"{flag}: {path}: {message}") from None
    written = checkpoint_config(run_dir)
    if written is not None:
        checkpoint, under = written
        refused = [k for k in changed_settings(under, saved) if k not in RESUMABLE]
        if refused:
            key = refused[0]
            old, new = _flat(to_dict(under)).get(key), _flat(to_dict(saved)).get(key)
            raise ConfigError(
                f"{flag}: {key} is {_short(new)} in {path} but {_short(old)} in the settings {checkpoint} "
                f"was written under: the saved config was edited, and {key} cannot change on resume (as with "
                f"--set); only {', '.join(RESUMABLE)} may; restore it, or start a new run for other settings"
            )
    return saved


def checkpoint_config(run_dir: str | Path) -> tuple[Path, TrainConfig] | None:
    """The newest checkpoint that records the settings it was written under, and those settings (None: no
    checkpoint records them). Read from its client state as untrusted JSON; links are never followed."""
    root = Path(run_dir) / "checkpoints"
    if expect(root, "dir") != "dir":
        return None
    found = sorted((p for p in root.iterdir() if _CHECKPOINT.fullmatch(p.name)), reverse=True)
    for path in found:
        if expect(path, "dir") != "dir" or expect(path / STATE_FILE, "file") != "file":
            continue
        try:
            config = read_client_state(path).get(CONFIG_KEY)
            if isinstance(config, dict):
                return path, from_dict(TrainConfig, config)
        except (CheckpointError, ConfigError) as exc:  # a torn one: resume falls back past it too
            log.warning("%s: its settings cannot be read (%s); trying the checkpoint before it", path, exc)
    return None


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def resume_config(
    run_dir: str | Path, config_file: str | Path | None, overrides: Sequence[str]
) -> TrainConfig:
    """The saved settings of the run in `run_dir`, then `config_file`, then `overrides`; refused unless the
    result differs from the saved run only in `RESUMABLE` (the error names the first key that differs)."""
    if not os.path.lexists(run_dir):  # said before anything loads (torch takes seconds)
        raise RunDirError(
            f"--resume: {run_dir} does not exist, so there is no run to continue; start one without --resume"
        )
    expect(Path(run_dir) / MARKER, "file")
    if not is_run_dir(Path(run_dir)):
        raise RunDirError(f"--resume: {run_dir} holds no treetrain run (no {MARKER} marker there)")
    saved = saved_config(run_dir)
    data = to_dict(saved)
    if config_file is not None:
        _merge(data, read_file(config_file))
    for assignment in overrides:
        apply_override(data, assignment)
    data["run_dir"] = str(run_dir)
    cfg = from_dict(TrainConfig, data)
    check_resumable(saved, cfg, Path(run_dir) / SAVED_CONFIG)
    return cfg


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, Mapping):
        return {prefix.rstrip("."): value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_flat(item, f"{prefix}{key}."))
    return out if out or not prefix else {prefix.rstrip("."): {}}


def changed_settings(saved: TrainConfig, cfg: TrainConfig) -> list[str]:
    """Dotted keys whose value differs between two configs, sorted."""
    a, b = _flat(to_dict(saved)), _flat(to_dict(cfg))
    return sorted(k for k in a.keys() | b.keys() if a.get(k, _MISSING) != b.get(k, _MISSING))


_MISSING = object()


def check_resumable(saved: TrainConfig, cfg: TrainConfig, where: Path) -> None:
    """Refuse `cfg` as a resume of `saved` when a setting outside `RESUMABLE` differs (one line, naming it)."""
    refused = [k for k in changed_settings(saved, cfg) if k not in RESUMABLE]
    if not refused:
        return
    key = refused[0]
    old, new = _flat(to_dict(saved)).get(key), _flat(to_dict(cfg)).get(key)
    more = f" (and {len(refused) - 1} more: {', '.join(refused[1:4])})" if len(refused) > 1 else ""
    raise ConfigError(
        f"--resume: {key} is {_short(old)} in the saved run ({where}) and cannot change on resume "
        f"(asked {_short(new)}){more}; only {', '.join(RESUMABLE)} may; start a new run for other settings"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
