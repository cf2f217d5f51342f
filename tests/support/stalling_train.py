"""`treetrain` (the command line) whose trainer stands still at one named point: the entry the
interruption tests (tests/train/test_interrupt.py) start in a process of their own, to kill it there.

    python tests/support/stalling_train.py POINT[@UPDATE][#RANK] ARRIVED_FILE train --run-dir ... --set ...

The trainer and its torch backend call their `on_point` hook at named points (`"update-end"`,
`"checkpoint-write"`); this script builds every trainer with a hook that, at `POINT` (of update `UPDATE`
when given; on rank `RANK` alone when given, the others going on, under torchrun) writes the process id to
`ARRIVED_FILE`, so the test knows it arrived, and sleeps until killed. Production code reads no test setting: the seam is this script's constructor argument.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetrain.cli.main import main
from treetrain.train import loop


@dataclass(frozen=True)
class StallAt:
    """An `on_point` hook that stops the process at `point` (of update `update`, or of any when None; on
    torchrun rank `rank` alone, or on every process when None)."""

    point: str
    update: int | None
    arrived: Path
    rank: int | None = None

    @staticmethod
    def parse(spec: str, arrived: Path) -> StallAt:
        spec, _, rank = spec.partition("#")
        name, _, at = spec.partition("@")
        return StallAt(name, int(at) if at else None, arrived, int(rank) if rank else None)

    def __call__(self, point: str, update: int | None) -> None:
        if point != self.point or (self.update is not None and update != self.update):
            return
        if self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank:
            return
        self.arrived.write_text(str(os.getpid()))
        while True:
            time.sleep(0.05)


def start_stalling(args: list[str], point: str, arrived: Path) -> subprocess.Popen[str]:
    """Start `treetrain ARGS` in its own process under this script and return once it stands still at
    `point` (`POINT[@UPDATE]`), which it says by writing its pid to `arrived`."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, __file__, point, str(arrived), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not arrived.exists():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {point}: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"never reached {point}"
        time.sleep(0.1)
    return proc


def run(argv: list[str]) -> int:
    spec, arrived, *rest = argv
    hook = StallAt.parse(spec, Path(arrived))

    class StallingTrainer(loop.Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, on_point=hook, **kwargs)

    loop.Trainer = StallingTrainer  # type: ignore[misc]  # the CLI imports the trainer when it runs
    return main(rest)


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
