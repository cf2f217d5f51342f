"""`treetrain train` on a full disk, at every kind of write it makes: the checkpoint's weights (safetensors),
its optimizer state (torch's zip writer), the metrics line, every atomic file (marker, config, tree files,
summary, plot; os.fsync is where the disk says so), and a real 256 KiB tmpfs as the run directory (root only; the tiny model's checkpoint is larger).
Each ends in one line naming the directory and the space needed, exit status 2, no traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors import SafetensorError
from support.tree_samples import TINY_BYTES

from treetrain.cli.main import main

pytestmark = pytest.mark.launch  # end-to-end runs: each starts its environment worker processes

TRAIN = [
    "--no-progress",
    "--set",
    "model.path=tiny-llama",
    "--set",
    "updates=2",
    "--set",
    "measure_memory_every=0",
]


def _raise(error: BaseException) -> Callable[..., None]:
    def fail(*args: object, **kwargs: object) -> None:
        raise error

    return fail


@contextlib.contextmanager
def _full_file(*args: object) -> Iterator[Any]:
    class Full:
        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    yield Full()


def _patch(monkeypatch: pytest.MonkeyPatch, site: str) -> None:
    import treetrain.distributed.backend as backend
    import treetrain.train.metrics as metrics

    if site == "checkpoint weights":
        monkeypatch.setattr(
            backend, "save_model", _raise(SafetensorError("IoError: No space left on device (os error 28)"))
        )
    elif site == "checkpoint optimizer":
        pos = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 930112 vs 930004")
        monkeypatch.setattr(backend.torch, "save", _raise(pos))
    elif site == "metrics line":  # the append's file says ENOSPC without naming itself, as os.write does
        monkeypatch.setattr(metrics, "open_file", _full_file)
    else:
        monkeypatch.setattr(os, "fsync", _raise(OSError(errno.ENOSPC, "No space left on device")))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "site", ["checkpoint weights", "checkpoint optimizer", "metrics line", "every atomic file"]
)
def test_a_full_disk_at_every_write_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], site: str
) -> None:
    tree = tmp_path / "tiny.msgpack"
    tree.write_bytes(TINY_BYTES)
    run = tmp_path / "run"
    _patch(monkeypatch, site)
    code = main(["train", "--trees", str(tree), "--run-dir", str(run), *TRAIN])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("INFO", "WARNING"))]
    assert code == 2 and "Traceback" not in out + err, err[-3000:]
    assert len(lines) == 1 and "no space left on the device" in lines[0], err[-3000:]
    assert lines[0].startswith(f"treetrain train: {run}"), lines[0]
    assert "is free; free some space there or use another --run-dir" in lines[0]
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    assert leftovers == [], leftovers  # nothing half-written


def test_a_run_directory_on_a_full_tmpfs_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)]).returncode
    ):
        pytest.skip("needs root to mount a tmpfs")
    try:
        tree = tmp_path / "tiny.msgpack"
        tree.write_bytes(TINY_BYTES)
        code = main(["train", "--trees", str(tree), "--run-dir", str(disk / "run"), *TRAIN])
        err = capsys.readouterr().err
        last = [line for line in err.splitlines() if line.strip()][-1]
        assert code == 2 and "Traceback" not in err, err[-3000:]
        assert (
            last.startswith(f"treetrain train: {disk / 'run'}") and "no space left on the device" in last
        ), last
        assert "this write needs at least" in last
        assert [p for p in disk.rglob("*") if ".tmp" in p.name] == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)
