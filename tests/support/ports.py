"""Launching torchrun from tests: a free port, and a timeout that ends every process of the launch.

Several launches (tests, or several people) run at once, so a fixed port would collide; the port is free
when returned and torchrun binds it a moment later. torchrun starts its workers in sessions of their
own, and they outlive a killed torchrun, so a timeout kills torchrun and every process below it: a
deadlock fails the test and leaves nothing running. Output goes to a file, so a launch never blocks on a full pipe while the test
waits for another one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Launched:
    returncode: int | None
    """None when the launch ran past its timeout and was killed."""
    output: str
    """stdout and stderr together."""


def run_all(cmds: Sequence[Sequence[str]], env: dict[str, str], timeout: float) -> list[Launched]:
    """Start every command at once, each in its own session; wait at most `timeout` seconds for all."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in cmds]
        procs = [
            subprocess.Popen(
                list(c), env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
            for c, log in zip(cmds, logs)
        ]
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p, code in zip(procs, codes):
            if code is None:
                kill_tree(p.pid)
                p.wait()
        out = []
        for code, log in zip(codes, logs):
            log.seek(0)
            out.append(Launched(code, log.read()))
        return out


STALLING = Path(__file__).resolve().parent / "stalling_train.py"


@contextlib.contextmanager
def stalling_ranks(
    point: str,
    arrived: Path,
    args: Sequence[str],
    log: Path,
    *,
    wait: Sequence[Path] = (),
    timeout: float = 300,
) -> Iterator[subprocess.Popen[bytes]]:
    """`treetrain ARGS` on two ranks under torchrun through `support/stalling_train.py` (the rank `point` names
    stands still there and writes its pid to `arrived`), its output in `log`. Yields the launch once
    `arrived` and every path of `wait` exist (an assertion with the output's tail if the launch ends or
    `timeout` passes first); on leaving, torchrun and every process below it are killed."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", str(STALLING), point, str(arrived), *args,
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while not all(p.exists() for p in (arrived, *wait)):
                assert proc.poll() is None and time.monotonic() < deadline, (
                    f"never reached {point} ({proc.poll()=}):\n{log.read_text()[-3000:]}"
                )
                time.sleep(0.1)
            yield proc
        finally:
            kill_tree(proc.pid)
            proc.wait()


def kill_tree(pid: int) -> None:
    """Kill a process and all its descendants (children first listed, then killed together)."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def run(cmd: Sequence[str], env: dict[str, str], timeout: float) -> Launched:
    return run_all([cmd], env, timeout)[0]


def calibrate_run(settings: Sequence[str]) -> None:
    """Measure, in this process, the memory calibrations a `treetrain train --set SETTINGS` run asks for, into
    the run's calibration store (`tests/conftest.py`; `treetrain.train.prewarm`): every rank of a launch
    would otherwise measure them itself, under ZeRO-3 slowly."""
    from treetrain.train.prewarm import prewarm_calibrations

    prewarm_calibrations(settings)


def train_ranks(
    run_dir: object, settings: Sequence[str], *extra: str, timeout: float, ranks: int = 2
) -> Launched:
    """`treetrain train --run-dir RUN --no-progress EXTRA --set ...` on `ranks` processes under torchrun
    (loopback, a free port, DeepSpeed on CPU, one thread per rank), its model's memory calibrations measured
    here first (`calibrate_run`)."""
    calibrate_run(settings)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", "-m", "treetrain", "train", "--run-dir", str(run_dir), "--no-progress",
        *extra, *(a for kv in settings for a in ("--set", kv)),
    ]  # fmt: skip
    return run(cmd, {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, timeout)
