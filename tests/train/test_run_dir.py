"""The run directory: the marker, what --overwrite may delete, the lock, leftovers, torn checkpoints, and
checkpoints by time. Everything here runs without training (a tiny model at most)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from treetrain.cli.main import main
from treetrain.distributed.checkpoint_io import CheckpointError
from treetrain.train.rundir import LOCK, MARKER, RunDirError, claim_run_dir, remove_run_artifacts

SETS = [a for kv in ["model.path=tiny-llama", "updates=1"] for a in ("--set", kv)]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path: Path, capsys) -> None:
    """The user's own checkpoints/my-model.pt survives --overwrite: the directory is not a treetrain run."""
    mine = tmp_path / "mine"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "checkpoints" / "my-model.pt").write_bytes(b"weights")
    before = _tree(mine)
    assert main(["train", "--run-dir", str(mine), "--overwrite", "--no-progress", *SETS]) == 2
    err = capsys.readouterr().err
    assert "not a treetrain run directory" in err and "checkpoints" in err and len(err.splitlines()) == 1
    assert _tree(mine) == before and sorted(p.name for p in mine.iterdir()) == ["checkpoints"]
    assert main(["train", "--run-dir", str(mine), "--resume", "--no-progress", *SETS]) == 2
    assert "holds no treetrain run" in capsys.readouterr().err
    assert _tree(mine) == before


def test_a_fresh_run_never_writes_over_user_files(tmp_path: Path, capsys) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own config\n")
    assert main(["train", "--run-dir", str(mine), "--no-progress", *SETS]) == 2
    assert "not a treetrain run directory" in capsys.readouterr().err
    assert (mine / "config.yaml").read_text() == "my: own config\n"
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        claim_run_dir(tmp_path / "file", resume=False, overwrite=False)


def test_overwrite_removes_only_what_a_run_wrote(tmp_path: Path) -> None:
    run = tmp_path / "run"
    claim_run_dir(run, resume=False, overwrite=False).release()
    written = [
        "config.yaml", "metrics.jsonl", "summary.txt", "reward.png", "final/model.safetensors",
        "checkpoints/update-00001/model.safetensors", "checkpoints/.update-00002.tmp-0123456789ab/x",
        "rollouts/update-00000/a.msgpack", "tensorboard/events", ".config.yaml.abcd_123.tmp", "final-merged/w",
        "engine-weights/current/model-00000.safetensors", "engine-weights/.current.tmp-0123456789ab/x",
        "eval/update-00001/trees/a.msgpack", "env-errors/update-00001.log",
    ]  # fmt: skip
    users = ["checkpoints/my-model.pt", "rollouts/notes.txt", "notes.md", "final-answer/x", "eval/mine.txt"]
    for name in written + users:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(name)
    with pytest.raises(RunDirError, match="already holds a run"):
        claim_run_dir(run, resume=False, overwrite=False)
    lock = claim_run_dir(run, resume=False, overwrite=True)
    remove_run_artifacts(run)
    lock.release()
    assert sorted(_tree(run)) == sorted([*users, MARKER, LOCK])
    assert all((run / name).read_text() == name for name in users)


def test_what_a_run_stopped_at_update_0_keeps_is_taken_as_new_and_nothing_else(tmp_path: Path) -> None:
    """`abandon_run_dir(keep_env_errors=True)` keeps the marker and env-errors/ only; a fresh claim takes
    that as a new directory (removing the old logs). A file of the user's in env-errors/, or any other
    entry, keeps the usual refusal (the negative control)."""
    from treetrain.train.rundir import abandon_run_dir

    run = tmp_path / "run"
    lock = claim_run_dir(run, resume=False, overwrite=False)
    (run / "config.yaml").write_text("x")
    (run / "rollouts" / "update-00000" / "trees").mkdir(parents=True)
    (run / "env-errors").mkdir()
    (run / "env-errors" / "update-00000.log").write_text("traceback")
    note = abandon_run_dir(run, lock, keep_env_errors=True)
    assert (
        note
        == f"the run never started; {run} keeps only env-errors/, and a new run there needs no --overwrite"
    )
    assert sorted(p.name for p in run.iterdir()) == [MARKER, "env-errors"]
    again = claim_run_dir(run, resume=False, overwrite=False)
    assert again.fresh and not (run / "env-errors").exists()
    again.release()
    (run / "env-errors").mkdir()
    (run / "env-errors" / "update-00000.log").write_text("traceback")
    (run / "env-errors" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="already holds a run"):
        claim_run_dir(run, resume=False, overwrite=False)
    assert (run / "env-errors" / "notes.txt").read_text() == "mine"


def test_the_docs_list_everything_overwrite_removes() -> None:
    """docs/run-directory.md's `--overwrite` bullet names every entry a run owns, `eval/` included."""
    from treetrain.train.rundir import ENV_ERRORS, OWN_DIRS, OWN_FILES, OWN_PARENTS

    text = (Path(__file__).resolve().parents[2] / "docs" / "run-directory.md").read_text()
    bullet = text[text.index("- `--overwrite` on a treetrain run") :].split("\n- ")[0]
    named = [
        *(f"`{f}`" for f in OWN_FILES),
        *(f"`{d}/`" for d in OWN_DIRS),
        *(f"`{p}/update-NNNNN/`" for p in OWN_PARENTS),
        f"`{ENV_ERRORS}/update-NNNNN.log`",
    ]
    assert [n for n in named if n not in bullet] == []
    cut = bullet.replace("`eval/update-NNNNN/`", "")  # the control: the bullet as it was, without eval/
    assert [n for n in named if n not in cut] == ["`eval/update-NNNNN/`"]


def test_leftovers_of_interrupted_writes_are_cleaned_up(tmp_path: Path) -> None:
    run = tmp_path / "run"
    claim_run_dir(run, resume=False, overwrite=False).release()
    (run / "checkpoints" / ".update-00002.tmp-0123456789ab").mkdir(parents=True)
    (run / "checkpoints" / "update-00001").mkdir()
    (run / ".final.old-0123456789ab").mkdir()  # killed between moving the old export aside and the swap
    (run / ".final.old-0123456789ab" / "model.safetensors").write_text("previous export")
    (run / ".metrics.jsonl.k2j4_x9a.tmp").write_text("partial")
    (run / ".reward.png.ab12cd34.tmp").write_bytes(b"partial png")
    (run / "engine-weights" / ".current.tmp-0123456789ab").mkdir(parents=True)  # a sync killed mid-write
    (run / "engine-weights" / "current").mkdir()
    claim_run_dir(run, resume=True, overwrite=False).release()
    assert sorted(p.name for p in (run / "engine-weights").iterdir()) == ["current"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["update-00001"]
    assert sorted(p.name for p in run.iterdir()) == [LOCK, MARKER, "checkpoints", "engine-weights", "final"]
    assert (run / "final" / "model.safetensors").read_text() == "previous export"


def test_the_lock_refuses_a_second_process_and_dies_with_its_holder(tmp_path: Path) -> None:
    """An flock held by another process refuses the run; `kill -9` of that process frees it at once."""
    run = tmp_path / "run"
    claim_run_dir(run, resume=False, overwrite=False).release()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(run / LOCK)!r}, os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.ftruncate(fd, 0)\nos.pwrite(fd, str(os.getpid()).encode(), 0)\nprint('locked', flush=True)\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        for resume in (False, True):
            with pytest.raises(
                RunDirError, match=rf"in use by another treetrain process \(pid {holder.pid}\)"
            ):
                claim_run_dir(run, resume=resume, overwrite=False)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    claim_run_dir(run, resume=True, overwrite=False).release()


def test_a_torn_latest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, caplog) -> None:
    from treetrain.distributed.backend import TorchBackend
    from treetrain.distributed.optim_config import OptimizerConfig
    from treetrain.models.presets import load_model
    from treetrain.train.trainer_state import TrainerState, resume_state, save_trainer_state

    backend = TorchBackend(load_model("tiny-llama", vocab_size=64), OptimizerConfig(lr=0.1))
    run = tmp_path / "run"
    assert resume_state(backend, run) is None
    for update in (1, 2):
        save_trainer_state(backend, run, TrainerState(update=update, version=update))
    weights = run / "checkpoints" / "update-00002" / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    with caplog.at_level(logging.WARNING):
        found = resume_state(backend, run)
    assert found is not None and found[0] == TrainerState(update=1, version=1)
    assert found[1].name == "update-00001"
    assert "update-00002" in caplog.text and "resuming from" in caplog.text
    (run / "checkpoints" / "update-00001" / "client_state.json").write_text('{"schema": "treetrain.client')
    with pytest.raises(CheckpointError, match=r"update-00002: .*; update-00001: ") as err:
        resume_state(backend, run)
    assert "\n" not in str(err.value)


def test_checkpoints_by_count_by_time_and_never_before_the_last(monkeypatch) -> None:
    from treetrain.train.loop import Trainer

    def due(index: int, every: int, every_s: float, elapsed: float, updates: int = 10) -> bool:
        fake = SimpleNamespace(
            cfg=SimpleNamespace(updates=updates, checkpoint_every=every, checkpoint_every_s=every_s),
            backend=SimpleNamespace(world_size=1),
        )
        monkeypatch.setattr(time, "monotonic", lambda: 1000.0 + elapsed)
        return Trainer._checkpoint_due(fake, index, 1000.0)  # type: ignore[arg-type]

    assert [i for i in range(10) if due(i, 3, 0, 0)] == [2, 5, 8]
    assert not due(0, 20, 600, 599) and due(0, 20, 600, 600) and due(4, 0, 60, 61)
    assert not due(0, 0, 0, 10**6)
    assert not due(9, 1, 1, 10**6), "the last update's checkpoint is the final one, saved after the loop"
