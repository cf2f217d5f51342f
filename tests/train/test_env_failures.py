"""A misbehaving environment cannot crash the trainer (through the CLI, tests/assets/misbehaving).

Each fault either ends its task's episode (the group is dropped, training goes on, `failed_episodes`
counts it, the traceback is in `env-errors/`), stops the run with one line naming the environment, the
method, the exception and the traceback file when every task fails, or, when it happens while the
environment is built, is one line before any model loads. `os._exit(0)` in environment code never ends the
trainer with status 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from treetrain.cli.main import main
from treetrain.train.metrics import read_metrics

pytestmark = pytest.mark.launch  # end-to-end runs: each starts its environment worker processes

ASSETS = str(Path(__file__).resolve().parents[1] / "assets" / "misbehaving")
ENV = "misbehaving_env:Misbehaving"
SETTINGS = [
    "model.path=tiny-llama", f"env.name={ENV}", "rollout.groups_per_update=2", "rollout.fanout.root=2",
    "rollout.episode.max_turns=2", "rollout.episode.max_turn_tokens=4", "advantages.zero_variance=keep",
    "measure_memory_every=0", "threads=1", "updates=1",
]  # fmt: skip


def _args(run: Path, fault: str, seeds: str) -> list[str]:
    sets = [*SETTINGS, f"env.kwargs.fault={fault}", f"env.kwargs.seeds={seeds}"]
    return ["train", "--run-dir", str(run), "--no-progress", *(a for kv in sets for a in ("--set", kv))]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("treetrain train:")]


# (fault, method named in the line, exception named in the line)
STOPS = [
    ("step", "step", "RuntimeError: step fault"),
    ("step_dict", "step", "returned {'done': True}, not a StepResult"),
    (
        "nan",
        "rubric 'length' (Length.score)",
        "ProtocolError: Length's reward is nan; rewards must be finite",
    ),
    (
        "inf",
        "rubric 'length' (Length.score)",
        "ProtocolError: Length's reward is inf; rewards must be finite",
    ),
    ("exit", "step|fork", "WorkerExited: the worker process exited with status 0"),
]
"""A worker that exits fails every call waiting on it: the step that exited, or a sibling sample's fork in
flight at the same moment, whichever the rollout hears of first; a call made after it broke names the same
cause (`WorkerGone: the worker had already stopped (WorkerExited: ...)`)."""
BEFORE_ANY_MODEL = [
    ("init", "__init__", "RuntimeError: init fault"),
    ("reset", "reset", "RuntimeError: reset fault"),
    ("reset_none", "reset", "returned None, not a non-empty sequence of Message"),
    ("nocopy", "fork", "TypeError: cannot pickle '_thread.lock' object"),
]


@pytest.fixture(autouse=True)
def _misbehaving_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(ASSETS)  # the worker process starts with the trainer's sys.path


def _refusal(run: Path, fault: str, capsys: pytest.CaptureFixture[str], method: str, exception: str) -> str:
    """Train with `fault` in every task: exit status 2, no traceback, and one line naming the environment,
    the method (`a|b`: either) and the exception. Returns the line."""
    assert main(_args(run, fault, "all")) == 2
    err = capsys.readouterr().err
    (line,) = _error_lines(err)
    assert "Traceback" not in err
    methods = "|".join(re.escape(m) for m in method.split("|"))
    later = re.escape("WorkerGone: the worker had already stopped (")  # a call made after the worker broke
    assert re.search(f"{re.escape(ENV)}: ({methods}) raised ({later})?{re.escape(exception)}", line), line
    return line


@pytest.mark.parametrize(("fault", "method", "exception"), STOPS)
def test_a_fault_in_every_task_stops_the_run_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str, method: str, exception: str
) -> None:
    run = tmp_path / "run"
    line = _refusal(run, fault, capsys, method, exception)
    log = run / "env-errors" / "update-00000.log"
    assert line.startswith("treetrain train: update 0: every task failed (2 of 2")
    assert line.endswith(
        f"traceback in {log}; the run never started; {run} keeps only env-errors/, and a new run there needs no --overwrite"
    )
    assert log.is_file() and exception in log.read_text()
    assert sorted(p.name for p in run.iterdir()) == [".treetrain-run", "env-errors"]  # nothing half-made
    if fault == "step":  # the raising line; a NaN was returned, a dead worker reports no traceback
        assert (
            "Traceback (most recent call last)" in log.read_text() and "misbehaving_env.py" in log.read_text()
        )
    assert not (run / "final").exists()


@pytest.mark.parametrize("fault", ["step", "step_dict", "nan", "inf", "exit", "reset", "long_prompt"])
def test_a_fault_in_one_task_drops_its_group_and_training_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str
) -> None:
    run = tmp_path / "run"
    assert main(_args(run, fault, "odd")) == 0, capsys.readouterr().err[-3000:]
    assert _error_lines(capsys.readouterr().err) == []
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row.failed_episodes == 1 and row.groups == 2  # task seed 1 failed, task seed 0 trained
    assert row.groups_dropped == 1 and row.step_timeouts == 0
    assert (run / "final" / "model.safetensors").is_file()
    log = (run / "env-errors" / "update-00000.log").read_text()
    assert log.startswith(f"== task seed 1: {ENV}: ") and "task seed 0" not in log
    if fault == "long_prompt":  # a trainer-side failure: its traceback too
        assert "PromptTooLongError" in log and "Traceback (most recent call last)" in log


@pytest.mark.parametrize("seeds", ["odd", "even"])
def test_a_long_prompt_fails_its_own_task_wherever_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seeds: str
) -> None:
    """Task seed 0 is the one the start-up checks open: a long prompt there is one failed task too, as
    anywhere else, not a run that never starts (the outcome does not depend on the task order)."""
    run = tmp_path / "run"
    assert main(_args(run, "long_prompt", seeds)) == 0, capsys.readouterr().err[-3000:]
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row.failed_episodes == 1 and row.groups == 2 and row.groups_dropped == 1
    failed = 0 if seeds == "even" else 1
    assert (run / "env-errors" / "update-00000.log").read_text().startswith(f"== task seed {failed}: ")


def test_a_budget_the_template_alone_fills_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What every prompt holds (the chat template around empty messages) not fitting is the setup's fault:
    one line before the first rollout, and nothing left behind."""
    run = tmp_path / "run"
    assert main([*_args(run, "none", "all"), "--set", "rollout.episode.max_episode_tokens=3"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert "rollout.episode.max_episode_tokens: the chat template and the tools alone take" in line
    assert "max_episode_tokens=3" in line and not run.exists()


def test_a_run_stopped_at_its_first_update_leaves_a_directory_the_next_run_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every task failing at update 0 keeps the traceback the line names and nothing else; a fresh run in
    the same directory then starts without --overwrite (and removes that traceback)."""
    run = tmp_path / "run"
    assert main(_args(run, "step", "all")) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line.endswith(f"{run} keeps only env-errors/, and a new run there needs no --overwrite")
    assert sorted(p.name for p in run.iterdir()) == [".treetrain-run", "env-errors"]
    assert main(_args(run, "none", "all")) == 0, capsys.readouterr().err[-3000:]
    assert (run / "final" / "model.safetensors").is_file() and not (run / "env-errors").exists()


def test_timeouts_are_counted_and_a_slow_rubric_ends_its_task_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MISBEHAVING_SLEEP_S", "1.5")
    run = tmp_path / "steps"
    assert main([*_args(run, "slow_step", "odd"), "--set", "rollout.episode.step_timeout_s=0.3"]) == 0
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row.step_timeouts == 4 and row.failed_episodes == 0  # seed 1: 2 samples x 2 turns, each timed out
    warned = [r.getMessage() for r in caplog.records if "environment steps missed" in r.getMessage()]
    assert len(warned) == 1 and "4 environment steps missed rollout.episode.step_timeout_s=0.3s" in warned[0]

    run = tmp_path / "rubric"
    assert (
        main(
            [
                *_args(run, "slow_rubric", "odd"),
                "--set",
                "rollout.rubric_timeout_s=0.5",
                "--set",
                "rollout.env_workers=1",
            ]
        )
        == 0
    )
    (row,) = read_metrics(run / "metrics.jsonl")
    assert (
        row.failed_episodes == 1 and row.groups == 2 and row.groups_dropped == 1
    )  # seed 0, same worker, trained
    log = (run / "env-errors" / "update-00000.log").read_text()
    assert "rubric 'length' raised Timeout: no answer within 0.5s" in log


def test_a_well_behaved_run_counts_no_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Control for the test above: the same environment without a fault fails nothing and logs nothing."""
    run = tmp_path / "run"
    assert main(_args(run, "none", "all")) == 0
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row.failed_episodes == 0 and row.groups == 2 and not (run / "env-errors").exists()
    assert row.step_timeouts == 0 and row.groups_dropped == 0


def test_closing_stdout_in_the_environment_leaves_the_trainers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(_args(run, "close_stdout", "all")) == 0
    assert f"run directory: {run}" in capsys.readouterr().out  # the trainer still prints its summary
    (row,) = read_metrics(run / "metrics.jsonl")
    errors = "\n".join(p.read_text() for p in sorted((run / "env-errors").glob("*")))
    assert row.failed_episodes == 0, errors
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize(("fault", "method", "exception"), BEFORE_ANY_MODEL)
def test_an_environment_that_cannot_start_is_one_line_before_any_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str, method: str, exception: str
) -> None:
    run = tmp_path / "run"
    line = _refusal(run, fault, capsys, method, exception)
    assert ("misbehaving_env.py:" in line) == (fault in ("init", "reset"))  # the line that raised, if any
    assert not run.exists()  # nothing written: the run directory is claimed after this check


def test_max_failed_fraction_stops_a_run_that_loses_too_many_tasks(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main([*_args(run, "step", "odd"), "--set", "rollout.max_failed_fraction=0.25"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert "environment code failed in too many tasks (1 of 2, rollout.max_failed_fraction=0.25)" in line
    assert main([*_args(tmp_path / "bad", "step", "odd"), "--set", "rollout.max_failed_fraction=1.5"]) == 2
    assert "rollout.max_failed_fraction: must be in [0, 1], got 1.5" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_os_exit_0_in_environment_code_never_exits_0(tmp_path: Path) -> None:
    run = tmp_path / "run"
    path = os.pathsep.join(p for p in (ASSETS, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "treetrain", *_args(run, "exit", "all")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=500,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr)
    assert "Traceback" not in proc.stderr and "exited with status 0" in line
    assert not (run / "final").exists()
