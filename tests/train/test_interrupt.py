"""`treetrain train` killed (kill -9, SIGINT) at named points, then `--resume`d, ends exactly where an
uninterrupted run ends: the same metrics rows and the same final weights, nothing left behind. While the
killed-to-be process runs, a second run or a resume on its directory is refused by the lock.

The process is stopped at a point by the trainer's `on_point` hook, which the test-only entry
tests/support/stalling_train.py installs (production code reads no test setting)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.stalling_train import start_stalling

from treetrain.cli.main import main
from treetrain.train.config import load_config
from treetrain.train.loop import Trainer
from treetrain.train.metrics import UpdateMetrics, read_metrics

pytestmark = pytest.mark.launch  # runs the treetrain CLI, a notebook kernel or a script in a subprocess

SETTINGS = [
    "model.path=tiny-llama", "rollout.groups_per_update=2", "rollout.fanout.root=4", "rollout.episode.max_turns=2",
    "rollout.episode.max_turn_tokens=12", "optim.lr=0.01", "advantages.zero_variance=keep", "loss.entropy_coef=0.01",
    "measure_memory_every=0", "threads=1", "updates=3",
]  # fmt: skip
TIMING = {
    "rollout_seconds", "train_seconds", "trainer_idle_seconds", "sampler_idle_seconds", "peak_bytes",
    "predicted_peak_bytes",
}  # fmt: skip
ROUNDING = {"sampler_logprob_gap_mean", "sampler_logprob_gap_max"}
"""Float32 rounding between the sampler and the scoring pass (about 1e-7): the engine batches whatever is
ready, so the sampler's arithmetic, not its tokens, moves with timing. Compared at 1e-6, not 1e-9."""


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run everything is compared with."""
    threads = torch.get_num_threads()
    run = tmp_path_factory.mktemp("straight") / "run"
    try:
        Trainer(load_config(None, [*SETTINGS, f"run_dir={run}"]), progress=False).run()
    finally:
        torch.set_num_threads(threads)
    return run


def _args(run: Path, extra: list[str]) -> list[str]:
    return [
        "train",
        "--run-dir",
        str(run),
        "--no-progress",
        *(a for kv in SETTINGS + extra for a in ("--set", kv)),
    ]


def _start(run: Path, extra: list[str], point: str, tmp_path: Path) -> subprocess.Popen[str]:
    """Start `treetrain train` in its own process and return once it stands still at `point`."""
    return start_stalling(_args(run, extra), point, tmp_path / "arrived")


def _resume_and_compare(run: Path, extra: list[str], straight: Path, capsys) -> None:
    threads = torch.get_num_threads()
    try:
        assert main([*_args(run, extra), "--resume"]) == 0, capsys.readouterr().err[-3000:]
    finally:
        torch.set_num_threads(threads)
    leftovers = [p for p in run.rglob("*") if ".tmp" in p.name or ".old-" in p.name]
    assert leftovers == [], leftovers

    def rows(path: Path) -> list[dict[str, object]]:
        return [{k: v for k, v in vars(r).items() if k not in TIMING} for r in read_metrics(path)]

    got, want = rows(run / "metrics.jsonl"), rows(straight / "metrics.jsonl")
    assert [r["update"] for r in got] == [0, 1, 2], "an update was lost or doubled"
    for a, b in zip(got, want):
        for key in a:
            if key in ROUNDING and a[key] is not None:
                assert abs(a[key] - b[key]) < 1e-6 and a[key] < 1e-5, key  # type: ignore[operator]
            elif key == "sampler_gap_by_lag":  # (lag, mean, max, tokens): the gaps round like the two above
                pairs = list(zip(a[key], b[key]))  # type: ignore[call-overload]
                assert len(pairs) == len(a[key]) == len(b[key]), key  # type: ignore[arg-type]
                for (lag, mean, big, n), (lag_b, mean_b, big_b, n_b) in pairs:
                    assert (lag, n) == (lag_b, n_b) and abs(mean - mean_b) < 1e-6 and abs(big - big_b) < 1e-6
            elif isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
            else:
                assert a[key] == b[key], key
    wa = load_file(run / "final" / "model.safetensors")
    wb = load_file(straight / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-6, atol=1e-7) for k in wa)


def test_kill_9_during_a_checkpoint_write_then_resume(straight: Path, tmp_path: Path, capsys) -> None:
    """Checkpoints here come by time (every update); the process dies inside the write of the second one.
    While it stands there, another run and a resume on its directory are refused by its lock."""
    run = tmp_path / "run"
    extra = ["checkpoint_every=0", "checkpoint_every_s=0.000001"]
    proc = _start(run, extra, "checkpoint-write@2", tmp_path)
    try:
        assert main(_args(run, extra)) == 2
        assert f"in use by another treetrain process (pid {proc.pid})" in capsys.readouterr().err
        assert main([*_args(run, extra), "--resume"]) == 2
        assert "in use by another treetrain process" in capsys.readouterr().err
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert [r.update for r in read_metrics(run / "metrics.jsonl")] == [0, 1]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(names) == 2 and names[0].startswith(".update-00002.tmp-") and names[1] == "update-00001"
    _resume_and_compare(run, extra, straight, capsys)


@pytest.mark.parametrize(
    ("stop", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped by SIGTERM")],
    ids=["sigint", "sigterm"],
)
def test_a_stop_signal_before_the_first_checkpoint_then_resume(
    stop: signal.Signals, code: int, said: str, straight: Path, tmp_path: Path, capsys
) -> None:
    """Ctrl-C, or SIGTERM (a scheduler's stop, torchrun stopping the ranks), ends with one line and no
    traceback; with no checkpoint yet, --resume starts the same run over."""
    run = tmp_path / "run"
    extra = ["checkpoint_every=0", "checkpoint_every_s=0"]
    proc = _start(run, extra, "update-end@0", tmp_path)
    proc.send_signal(stop)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("INFO", "WARNING"))]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert said in lines[0] and "--resume" in lines[0]
    assert not (run / "checkpoints").exists() and len(read_metrics(run / "metrics.jsonl")) == 1
    _resume_and_compare(run, extra, straight, capsys)


def test_kill_9_between_checkpoints_then_resume(straight: Path, tmp_path: Path, capsys) -> None:
    """Killed after update 1's metrics row but before its checkpoint: the row is dropped and redone once."""
    run = tmp_path / "run"
    extra = ["checkpoint_every=1", "checkpoint_every_s=0"]
    proc = _start(run, extra, "update-end@1", tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert [r.update for r in read_metrics(run / "metrics.jsonl")] == [0, 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["update-00001"]
    _resume_and_compare(run, extra, straight, capsys)


def test_metrics_rows_compare_every_field() -> None:
    """The comparison above leaves out only wall-clock and measured-memory fields."""
    assert {f for f in UpdateMetrics.__dataclass_fields__} > TIMING
