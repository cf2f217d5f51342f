"""A link or a special file planted in a run directory is refused in one line and never followed.

Every entry treetrain writes, reads back or deletes there is planted in turn as a symlink to a user's file,
a symlink to a user's directory, a dangling symlink, a FIFO, and the wrong kind (a directory where a file
belongs, a file where a directory belongs); a fresh run, `--overwrite` and `--resume` must each end with one
line on stderr, no traceback, a non-zero exit, and the user's files exactly as they were. The write sites'
own primitives are checked directly too (a link planted after the run started).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from treetrain.cli.main import main
from treetrain.runfs import UnsafePathError, make_dirs, open_file, remove_tree
from treetrain.train.config import dump_config, load_config
from treetrain.train.metrics import MetricsWriter
from treetrain.train.rundir import LOCK, MARKER, claim_run_dir, remove_run_artifacts

FILES = (MARKER, LOCK, "config.yaml", "metrics.jsonl", "summary.txt", "reward.png")
DIRS = ("checkpoints", "rollouts", "final", "checkpoints/update-00001", "rollouts/update-00000")
PLANTS = ("link-to-file", "link-to-dir", "dangling", "fifo", "wrong-kind")
SETS = ["--set", "model.path=tiny-llama", "--set", "updates=1", "--no-progress"]


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root` with its content (files) or kind, never following a link."""
    out: dict[str, bytes | str] = {}
    for parent, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(parent) / name
            out[str(p.relative_to(root))] = (
                f"link:{os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir/fifo"
            )
    return out


def _user_area(tmp_path: Path) -> Path:
    user = tmp_path / "user"
    (user / "userdir" / "update-00007").mkdir(parents=True)
    (user / "userdir" / "update-00007" / "weights.pt").write_bytes(b"the user's weights")
    (user / "userdir" / "metrics.jsonl").write_text('{"mine": 1}\n')
    (user / "precious.txt").write_text("the user's file\n")
    return user


def _plant(path: Path, plant: str, user: Path, want_dir: bool) -> None:
    if path.exists() or path.is_symlink():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if plant == "link-to-file":
        path.symlink_to(user / "precious.txt")
    elif plant == "link-to-dir":
        path.symlink_to(user / "userdir")
    elif plant == "dangling":
        path.symlink_to(user / "not-there")
    elif plant == "fifo":
        os.mkfifo(path)
    elif want_dir:
        path.write_text("a file where a directory belongs\n")
    else:
        path.mkdir()


def _run_dir(tmp_path: Path) -> Path:
    """A treetrain run directory (marker, lock, saved config) with empty entries of each kind."""
    run = tmp_path / "run"
    claim_run_dir(run, resume=False, overwrite=False).release()
    (run / "config.yaml").write_text(
        dump_config(load_config(None, ["model.path=tiny-llama", f"run_dir={run}"]))
    )
    for name in DIRS:
        (run / name).mkdir(parents=True, exist_ok=True)
    return run


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    return err


@pytest.mark.parametrize("plant", PLANTS)
@pytest.mark.parametrize("entry", FILES + DIRS)
def test_a_planted_entry_is_refused_in_one_line_and_the_users_files_survive(
    tmp_path: Path, entry: str, plant: str, capsys
) -> None:
    user = _user_area(tmp_path)
    run = _run_dir(tmp_path)
    _plant(run / entry, plant, user, want_dir=entry in DIRS)
    before = _snapshot(user)
    for how in (["--overwrite"], ["--resume"], []):
        code = main(["train", "--run-dir", str(run), *SETS, *how])
        err = _one_line(capsys)
        assert code == 2, (how, err)
        if how or entry in (MARKER, LOCK):  # a fresh run may also just find the directory in use
            assert entry in err, (how, err)
        assert _snapshot(user) == before, how


def test_a_control_run_directory_without_plants_is_accepted_for_overwrite(tmp_path: Path) -> None:
    """Negative control: the same run directory with nothing planted passes the checks and is cleaned."""
    run = _run_dir(tmp_path)
    lock = claim_run_dir(run, resume=False, overwrite=True)
    remove_run_artifacts(run)
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == [LOCK, MARKER]


def test_writes_after_the_start_never_follow_a_planted_link(tmp_path: Path) -> None:
    """A link planted while a run goes on: appending metrics, creating a rollout directory and deleting a
    checkpoint are each refused, and the user's file and directory are untouched."""
    user = _user_area(tmp_path)
    run = _run_dir(tmp_path)
    writer = MetricsWriter(run)
    _plant(run / "metrics.jsonl", "dangling", user, want_dir=False)
    from test_progress import _row  # a valid metrics row

    with pytest.raises(UnsafePathError, match=r"metrics\.jsonl: a symbolic link"):
        writer.write(_row(0, 0))
    assert not (user / "not-there").exists()
    _plant(run / "rollouts" / "update-00000", "link-to-dir", user, want_dir=True)
    with pytest.raises(UnsafePathError, match="update-00000: a symbolic link"):
        make_dirs(run, run / "rollouts" / "update-00000" / "trees")
    _plant(run / "checkpoints", "link-to-dir", user, want_dir=True)
    with pytest.raises(UnsafePathError, match="checkpoints: a symbolic link"):
        remove_tree(run, run / "checkpoints" / "update-00007")
    (run / "metrics.jsonl").unlink()
    (run / "rollouts" / "update-00000").unlink()
    with pytest.raises(UnsafePathError, match="checkpoints: a symbolic link"):
        remove_run_artifacts(run)
    assert (user / "userdir" / "update-00007" / "weights.pt").read_bytes() == b"the user's weights"
    fifo = run / "summary.txt"
    _plant(fifo, "fifo", user, want_dir=False)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        open_file(run, fifo, "rb")  # refused on the descriptor: never blocks


def test_the_run_directory_itself_may_be_a_link(tmp_path: Path) -> None:
    """Only entries below the root are checked: `runs -> /scratch/runs` is the user's choice."""
    (tmp_path / "scratch").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "scratch")
    run = tmp_path / "runs" / "r"
    claim_run_dir(run, resume=False, overwrite=False).release()
    make_dirs(run, run / "rollouts" / "update-00000" / "trees")
    assert (tmp_path / "scratch" / "r" / "rollouts" / "update-00000" / "trees").is_dir()


def test_a_path_outside_the_run_directory_is_refused(tmp_path: Path) -> None:
    """The run-directory primitives only ever act below their root: a path elsewhere is one refusal (a
    path inside is made, the control)."""
    with pytest.raises(UnsafePathError, match="not inside the run directory"):
        make_dirs(tmp_path / "run", tmp_path / "elsewhere")
    assert make_dirs(tmp_path / "run", tmp_path / "run" / "rollouts").is_dir()
