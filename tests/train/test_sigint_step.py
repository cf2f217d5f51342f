"""Ctrl-C while an environment step runs in the environment worker (`rollout.episode.step_timeout_s`): the run ends with
one line and no traceback, leaves no half-written file, and `--resume` then completes the run.

Synchronization is a marker line the blocked step prints to stderr; the signal is sent only after the
test has read it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treetrain.cli.main import main
from treetrain.train.metrics import read_metrics

pytestmark = pytest.mark.launch  # runs the treetrain CLI, a notebook kernel or a script in a subprocess

TESTS = str(Path(__file__).resolve().parents[1])
MARKER = "BLOCKING-ENV: step thread is blocked"
SETTINGS = [
    "model.path=tiny-llama", "env.name=support.blocking_env:BlockingStepEnv", "rollout.groups_per_update=1",
    "rollout.fanout.root=2", "rollout.episode.max_turns=2", "rollout.episode.max_turn_tokens=4", "rollout.episode.step_timeout_s=600",
    "advantages.zero_variance=keep", "measure_memory_every=0", "threads=1", "updates=1",
]  # fmt: skip


def _args(run: Path) -> list[str]:
    return ["train", "--run-dir", str(run), "--no-progress", *(a for kv in SETTINGS for a in ("--set", kv))]


@pytest.mark.timeout(600)
def test_sigint_during_a_threaded_env_step_then_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
        "BLOCKING_ENV_MARKER": MARKER,
    }  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "treetrain", *_args(run)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        seen = []
        assert proc.stderr is not None
        for line in proc.stderr:  # blocks until the step thread has printed the marker (or the process ends)
            seen.append(line)
            if line.strip() == MARKER:
                break
        else:
            raise AssertionError(f"exited {proc.wait()} before the step blocked: {''.join(seen)[-3000:]}")
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = "".join(seen) + rest
    assert proc.returncode == 130, err[-3000:]
    lines = [  # each task's worker prints the marker when its step blocks: the environment's output, not ours
        line
        for line in rest.splitlines()
        if line.strip() and not line.startswith(("INFO", "WARNING")) and line.strip() != MARKER
    ]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert lines[0] == f"treetrain train: interrupted; continue with --resume --run-dir {run}"
    leftovers = [p for p in run.rglob("*") if ".tmp" in p.name or ".old-" in p.name]
    assert leftovers == [] and not (run / "checkpoints").exists()
    assert not (run / "metrics.jsonl").exists() or read_metrics(run / "metrics.jsonl") == []

    monkeypatch.syspath_prepend(TESTS)
    monkeypatch.delenv("BLOCKING_ENV_MARKER", raising=False)
    threads = torch.get_num_threads()
    try:
        assert main([*_args(run), "--resume"]) == 0, capsys.readouterr().err[-3000:]
    finally:
        torch.set_num_threads(threads)
    assert [r.update for r in read_metrics(run / "metrics.jsonl")] == [0]
    assert (run / "final" / "model.safetensors").is_file()
