"""The tiny trainer run the training tests share: a tiny Llama preset on the calculator environment,
two groups of four, two short turns, and a learning rate high enough for the weights to move visibly;
and the subprocess runs the end-to-end tests kill and resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TINY = [
    "model.path=tiny-llama",
    "rollout.groups_per_update=2",
    "rollout.fanout.root=4",
    "rollout.episode.max_turns=2",
    "rollout.episode.max_turn_tokens=12",
    "optim.lr=0.01",
    "advantages.zero_variance=keep",
    "loss.entropy_coef=0.01",
    "checkpoint_every=1",
]
"""`--set` overrides for a run of seconds (the defaults are the demo, which takes minutes)."""


def train_in_process(run: object, settings: list[str]) -> int:
    """`treetrain train --run-dir RUN --no-progress --set ...` in this process; the exit code. The run sets
    torch's thread count (`threads`), so the caller's is put back."""
    import torch

    from treetrain.cli.main import main

    threads = torch.get_num_threads()
    try:
        return main(
            ["train", "--run-dir", str(run), "--no-progress", *(a for s in settings for a in ("--set", s))]
        )
    finally:
        torch.set_num_threads(threads)


def train_process(run: Path, settings: list[str], *extra: str) -> subprocess.Popen[str]:
    """`treetrain train --run-dir RUN --no-progress --set ...` in a subprocess of one thread, stderr piped."""
    args = [sys.executable, "-m", "treetrain", "train", "--run-dir", str(run), "--no-progress", *extra]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*args, *(a for kv in settings for a in ("--set", kv))],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def kill_after_first_checkpoint(proc: subprocess.Popen[str], run: Path, within_s: float) -> None:
    """SIGKILL `proc` (no chance to clean up) once the run has written its first checkpoint."""
    try:
        deadline = time.monotonic() + within_s
        while not (run / "checkpoints").is_dir() or not list((run / "checkpoints").iterdir()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"no checkpoint within {within_s:.0f} s"
            time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
