"""The one bounded JSON reader and its three callers (LoRA adapter config, checkpoint client state,
DeepSpeed config) against hostile files: each ends in the caller's one-line error naming the file."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from treetrain.distributed.checkpoint_io import (
    MAX_STATE_BYTES,
    STATE_FILE,
    CheckpointError,
    read_client_state,
)
from treetrain.distributed.deepspeed_config import MAX_CONFIG_BYTES, read_config
from treetrain.errors import ConfigError
from treetrain.jsonfile import read_json_object
from treetrain.models.lora_config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MAX_ADAPTER_CONFIG_BYTES,
    check_adapter_dir,
)

HOSTILE: dict[str, tuple[Callable[[int], bytes], str]] = {
    "too big": (lambda limit: b'{"x": "' + b"a" * limit + b'"}', "larger than the limit"),
    "not UTF-8": (lambda limit: b'{"x": "\xff\xfe"}', "not UTF-8 text"),
    "deeply nested": (lambda limit: b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested too deeply"),
    "a 5,000-digit integer": (lambda limit: b'{"x": ' + b"9" * 5_000 + b"}", "not valid JSON"),
    "not an object": (lambda limit: b"[1, 2, 3]", "the top level must be an object, found a list"),
    "null": (lambda limit: b"null", "found null"),
    "truncated": (lambda limit: b'{"x": [1, 2', "invalid JSON at line 1"),
}


def _adapter(tmp: Path, blob: bytes) -> Path:
    (tmp / ADAPTER_CONFIG).write_bytes(blob)
    (tmp / ADAPTER_WEIGHTS).write_bytes(b"")
    return tmp / ADAPTER_CONFIG


def _state(tmp: Path, blob: bytes) -> Path:
    (tmp / STATE_FILE).write_bytes(blob)
    return tmp / STATE_FILE


def _deepspeed(tmp: Path, blob: bytes) -> Path:
    (tmp / "ds.json").write_bytes(blob)
    return tmp / "ds.json"


CALLERS = {
    "adapter": (_adapter, lambda tmp: check_adapter_dir(str(tmp)), ConfigError, MAX_ADAPTER_CONFIG_BYTES),
    "client state": (_state, read_client_state, CheckpointError, MAX_STATE_BYTES),
    "deepspeed": (_deepspeed, lambda tmp: read_config(tmp / "ds.json"), ConfigError, MAX_CONFIG_BYTES),
}


@pytest.mark.parametrize("caller", sorted(CALLERS))
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_json_files_are_one_line_errors_of_the_caller(tmp_path: Path, caller: str, case: str) -> None:
    write, read, error, limit = CALLERS[caller]
    make, expected = HOSTILE[case]
    path = write(tmp_path, make(limit))
    with pytest.raises(error) as info:
        read(tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and expected in message, message


def test_the_size_is_checked_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file larger than the limit is refused from its size alone: it is never opened."""
    path = tmp_path / "big.json"
    with open(path, "wb") as f:  # sparse: 1 TiB of size, no data
        f.truncate(1 << 40)
    opened: list[object] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    with pytest.raises(ValueError, match="1099511627776 bytes, larger than the limit of 1024 bytes"):
        read_json_object(path, max_bytes=1024)
    assert opened == []


def test_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_json_object(fifo, max_bytes=1024, error=CheckpointError)
    with pytest.raises(ValueError, match="cannot read it"):
        read_json_object(tmp_path / "missing.json", max_bytes=1024)


def test_a_good_file_reads_back(tmp_path: Path) -> None:
    (tmp_path / "ok.json").write_text('{"a": [1, 2], "b": "é"}')
    assert read_json_object(tmp_path / "ok.json", max_bytes=64) == {"a": [1, 2], "b": "é"}


METRICS_ROWS: dict[str, tuple[bytes, str]] = {
    "not UTF-8": (b'{"update": 0}\n\xff\xfe\n{"update": 1}\n', "not UTF-8 text"),
    "deeply nested": (
        b"[" * 200_000 + b"]" * 200_000 + b'\n{"update": 1}\n',
        ":1: not a metrics row: Recursion",
    ),
    "a list": (b'[1, 2]\n{"update": 1}\n', ":1: not a metrics row: TypeError: a JSON list, not an object"),
    "a text update": (b'{"update": "x"}\n{"update": 1}\n', "'update' is 'x', not a whole number"),
    "a 5,000-digit integer": (b'{"update": ' + b"9" * 5_000 + b'}\n{"update": 1}\n', ":1: not a metrics row"),
}


@pytest.mark.parametrize("case", sorted(METRICS_ROWS))
def test_a_hostile_metrics_file_is_one_metrics_error(tmp_path: Path, case: str) -> None:
    """metrics.jsonl is read back on --resume; the train CLI reports a MetricsError in one line."""
    from treetrain.train.metrics import MetricsError, read_metrics

    blob, expected = METRICS_ROWS[case]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(blob)
    with pytest.raises(MetricsError) as info:
        read_metrics(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value) and expected in str(info.value)
