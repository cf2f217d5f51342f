"""A full disk, as a class: every way a writer says it (os.write's ENOSPC and EDQUOT, torch's zip writer's
`unexpected pos`, safetensors' `No space left on device`, each also as the cause of another error), at every
kind of write a run makes (an atomic file: config, summary, plot, tree files, marker; an atomic directory:
checkpoints, the final export), is one `DiskFullError` line naming the directory and the space needed, and
leaves nothing half-written. Other errors pass through unchanged (the negative control)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import SafetensorError

from treetrain.diskfull import (
    SHARED_MEMORY,
    DiskFullError,
    UnplacedDiskFullError,
    as_disk_full,
    full_place,
    is_disk_full,
    mount_point,
    naming_full_disk,
)
from treetrain.io import atomic_directory, atomic_write_bytes


def _enospc() -> BaseException:
    return OSError(errno.ENOSPC, "No space left on device")


def _chained() -> BaseException:
    try:
        raise _enospc()
    except OSError as cause:
        try:
            raise RuntimeError("saving failed") from cause
        except RuntimeError as exc:
            return exc


FULL: dict[str, Callable[[], BaseException]] = {
    "ENOSPC": _enospc,
    "EDQUOT": lambda: OSError(errno.EDQUOT, "Disk quota exceeded"),
    "torch zip writer": lambda: RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 930112 vs 930004"
    ),
    "safetensors": lambda: SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    ),
    "chained": _chained,
}
NOT_FULL: dict[str, Callable[[], BaseException]] = {
    "permission": lambda: PermissionError(errno.EACCES, "Permission denied"),
    "a bug": lambda: RuntimeError("shape mismatch"),
    "a value": lambda: ValueError("bad"),
}


def _file_write(target: Path, error: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(fd: int) -> None:
        raise error

    monkeypatch.setattr(os, "fsync", fail)
    atomic_write_bytes(target / "config.yaml", b"x" * 5000)


def _dir_write(target: Path, error: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    with atomic_directory(target / "checkpoints" / "update-00001") as tmp:
        (tmp / "model.safetensors").write_bytes(b"w" * 7000)
        raise error


WRITES = {"atomic file": _file_write, "atomic directory": _dir_write}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("form", sorted(FULL))
def test_every_full_disk_is_one_line_naming_the_directory_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str, form: str
) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "update-00000").mkdir(parents=True)
    (run / "checkpoints" / "update-00000" / "model.safetensors").write_bytes(b"p" * 9000)
    (run / "config.yaml").write_text("old")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    with pytest.raises(DiskFullError) as info:
        WRITES[write](run, FULL[form](), monkeypatch)
    message = str(info.value)
    where = run if write == "atomic file" else run / "checkpoints"
    mount = mount_point(where)
    assert message.startswith(
        f"{where}: no space left on the device (the file system mounted at {mount}): "
    ), message
    assert "this write needs " in message
    assert "\n" not in message and message.endswith("is free; free some space there"), message
    assert "--run-dir" not in message  # a library write knows no command's options (`as_disk_full` adds them)
    needed = "4.9 KiB" if write == "atomic file" else "at least 8.8 KiB"  # the previous checkpoint's size
    assert needed in message, message
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # nothing half-written
    assert (run / "config.yaml").read_text() == "old"


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("form", sorted(NOT_FULL))
def test_other_errors_pass_through_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str, form: str
) -> None:
    error = NOT_FULL[form]()
    assert not is_disk_full(error)
    with pytest.raises(type(error)) as info:
        WRITES[write](tmp_path, error, monkeypatch)
    assert info.value is error and not isinstance(info.value, DiskFullError)


def test_naming_full_disk_asks_for_the_size_only_when_the_disk_is_full(tmp_path: Path) -> None:
    asked: list[int] = []

    def size() -> int:
        asked.append(1)
        return 3 << 20

    with naming_full_disk(tmp_path, size):
        pass
    assert asked == []
    with (
        pytest.raises(DiskFullError, match=r"needs 3\.0 MiB and .* is free"),
        naming_full_disk(tmp_path, size),
    ):
        raise FULL["torch zip writer"]()
    assert asked == [1]


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    return done.returncode == 0


def test_a_real_full_file_system_is_one_line(tmp_path: Path) -> None:
    """On a 1 MiB tmpfs (root only; skipped elsewhere) a real write of 2 MiB, as a file and as a directory."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("needs root to mount a tmpfs")
    try:
        with pytest.raises(
            DiskFullError,
            match=rf"^{disk}: no space left on the device: this write needs 2\.0 MiB",  # its own mount
        ):
            atomic_write_bytes(disk / "big.bin", b"z" * (2 << 20))
        with (
            pytest.raises(DiskFullError, match=rf"^{disk}: no space left"),
            atomic_directory(disk / "ckpt") as tmp,
        ):
            (tmp / "weights").write_bytes(b"z" * (2 << 20))
        assert sorted(os.listdir(disk)) == []  # nothing half-written
        atomic_write_bytes(disk / "small.bin", b"ok")  # negative control: what fits is written
        assert (disk / "small.bin").read_bytes() == b"ok"
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_the_place_a_disk_full_error_names_is_found_and_never_guessed(tmp_path: Path) -> None:
    named = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "a" / "metrics.jsonl"))
    assert full_place(named) == tmp_path / "a"
    assert full_place(OSError(errno.ENOSPC, "No space left on device", str(tmp_path))) == tmp_path
    shm = RuntimeError(
        "unable to allocate shared memory(shm) for file </torch_25132_2238930283_0>: No space left on device (28)"
    )
    assert full_place(shm) == SHARED_MEMORY
    try:
        raise RuntimeError("sharing the weights failed") from shm
    except RuntimeError as chained:
        assert full_place(chained) == SHARED_MEMORY
    assert full_place(_enospc()) is None  # an append's ENOSPC names no file
    assert full_place(FULL["torch zip writer"]()) is None


def test_the_advice_fits_the_place_that_was_full(tmp_path: Path) -> None:
    """`use another --run-dir` only for a place inside the run directory; shared memory is advised to be
    made larger; an error that names no place says so instead of naming the run directory."""
    run = tmp_path / "run"
    inside = as_disk_full(DiskFullError(run / "checkpoints", 10), run, "use another --run-dir")
    assert str(inside).endswith("; free some space there or use another --run-dir")
    elsewhere = as_disk_full(DiskFullError(tmp_path / "other", 10), run, "use another --run-dir")
    assert str(elsewhere).endswith("; free some space there") and "--run-dir" not in str(elsewhere)
    shm = RuntimeError(
        "unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left on device (28)"
    )
    line = str(as_disk_full(shm, run, "use another --run-dir"))
    assert line.startswith(f"{SHARED_MEMORY}: no space left on the device") and "--run-dir" not in line
    assert "make it larger (docker run --shm-size" in line
    unplaced = as_disk_full(_enospc(), run, "use another --run-dir")
    assert isinstance(unplaced, UnplacedDiskFullError) and "--run-dir" not in str(unplaced)
    assert str(unplaced).startswith("no space left on a device, and the error names no file (")
    assert f"is free in {run}" in str(unplaced) and "\n" not in str(unplaced)
    with pytest.raises(DiskFullError) as caught, naming_full_disk(SHARED_MEMORY, 4 << 20):
        raise OSError(errno.ENOSPC, "No space left on device")  # the real errno path, for a given path
    assert str(caught.value).startswith(
        f"{SHARED_MEMORY}: no space left on the device: this write needs 4.0 MiB"
    )
    assert "--shm-size" in str(caught.value)


@pytest.mark.launch  # a subprocess in a private mount namespace
def test_a_shared_memory_too_small_for_the_weights_is_one_line_naming_it(tmp_path: Path) -> None:
    """A private mount namespace with a 1 MiB /dev/shm (root and unshare only; skipped elsewhere): the
    asynchronous sampler's weight feed cannot share the weights there, and says so about /dev/shm."""
    script = (
        "import torch\n"
        "from treetrain.rollout.weight_feed import WeightFeed\n"
        "from treetrain.diskfull import DiskFullError\n"
        "try:\n"
        "    WeightFeed(torch.nn.Linear(1024, 1024), 0, shared=True)\n"
        "except DiskFullError as exc:\n"
        "    print(exc)\n"
    )
    root = Path(__file__).resolve().parents[2]
    command = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && PYTHONPATH={root} {sys.executable} -c '{script}'"
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", command], capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs over /dev/shm here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("/dev/shm: no space left on the device: this write needs 4.0 MiB and "), (
        done.stdout
    )
    assert "make it larger (docker run --shm-size" in done.stdout and "--run-dir" not in done.stdout
