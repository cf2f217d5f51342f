"""Hostile task files for the dataset environment: non-finite numbers, special files, a reward function
of the wrong signature, and the resource tracker's warnings after a `datasets` read in a worker."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envs.dataset import DatasetEnv, TaskFileError, read_rows
from envs.dataset.answers import call_problem

ROOT = Path(__file__).resolve().parents[2]
ROW = {"prompt": "What is 1 + 1?", "answer": "2"}


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [
        ('{"prompt": "x", "answer": NaN}', "answer", "nan"),
        ('{"prompt": "x", "answer": Infinity}', "answer", "inf"),
        ('{"prompt": "x", "answer": -Infinity}', "answer", "-inf"),
        ('{"prompt": "x", "answer": 1e999}', "answer", "inf"),
        ('{"prompt": "x", "answer": 1, "meta": {"w": [0.5, NaN]}}', "meta.w[1]", "nan"),
    ],
)
def test_a_non_finite_number_in_a_row_is_refused_naming_file_row_and_field(
    tmp_path: Path, text: str, field: str, value: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + text + "\n")
    with pytest.raises(TaskFileError) as caught:
        read_rows(path, needs=("answer",))
    assert (
        str(caught.value)
        == f"{path}: row 2: {field}: {value} is not a finite number (NaN and infinities are refused)"
    )
    path.write_text(json.dumps(ROW) + "\n" + json.dumps({"prompt": "x", "answer": 1e300}) + "\n")
    assert read_rows(path, needs=("answer",))[1].fields["answer"] == 1e300  # the control: finite is fine


def test_a_non_finite_number_in_parquet_is_refused(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "a", "answer": 1.0}, {"prompt": "b", "answer": math.nan}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(TaskFileError, match=r"t\.parquet: row 2: answer: nan is not a finite number"):
        read_rows(tmp_path / "t.parquet", needs=("answer",))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["the file", "inside a directory", "a device"])
def test_a_special_file_is_refused_at_once_naming_it(tmp_path: Path, where: str) -> None:
    """A FIFO would block the reader until a writer came (the worker's deadline, minutes later)."""
    if where == "a device":
        special = Path("/dev/null")
        path = special
    else:
        directory = tmp_path / "tasks"
        directory.mkdir()
        (directory / "a.jsonl").write_text(json.dumps(ROW) + "\n")
        special = directory / ("b.jsonl" if where == "inside a directory" else "fifo.jsonl")
        os.mkfifo(special)
        path = directory if where == "inside a directory" else special
    with pytest.raises(TaskFileError) as caught:
        read_rows(path, field="eval_path")
    assert str(caught.value) == (
        f"eval_path: {str(special)!r} is not a regular file (a FIFO, device or socket); give a task file or a "
        "directory of them"
    )
    with pytest.raises(ValueError, match="not a regular file"):
        DatasetEnv(str(path))


def test_a_reward_function_of_the_wrong_signature_is_refused_when_the_env_is_made(tmp_path: Path) -> None:
    """Caught here, before any model loads, not by the first rubric call after the first rollout."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    for reward, said in (
        ("json:loads", "json.loads(s, *, cls=None, object_hook=None, ...): too many positional arguments"),
        ("math:sqrt", "math.sqrt(x, /): too many positional arguments"),
        ("support.dataset_plugins:negate", "negate(x: 'int') -> 'int': too many positional arguments"),
    ):
        with pytest.raises(ValueError) as caught:
            DatasetEnv(str(path), reward=reward)
        assert str(caught.value).startswith(f"reward: {reward!r} cannot be called as fn(episode, row): ")
        assert said in str(caught.value)
    assert "missing a required argument: 'extra'" in str(call_problem(lambda episode, row, extra: 0.0, 2))
    assert call_problem(lambda episode, row, scale=1.0: 0.0, 2) is None
    DatasetEnv(str(path), reward="support.dataset_plugins:shorter_is_better")  # the right shape is taken


TRACKER_PROBE = """
import sys
from treetrain.errors import ConfigError
from treetrain.rollout.env_check import check_environment_config
if __name__ == "__main__":
    check_environment_config("dataset", {"path": sys.argv[1]})
    try:
        check_environment_config("dataset", {"path": sys.argv[2]})
    except ConfigError as exc:
        print(exc, file=sys.stderr)
"""

LEAKING_PROBE = """
import multiprocessing, os
def child():
    held = multiprocessing.RLock()  # noqa: F841 (held past os._exit, as tqdm holds its lock)
    os._exit(0)
if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child)
    p.start(); p.join()
"""


def _stderr(tmp_path: Path, script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    (tmp_path / "probe.py").write_text(script)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "probe.py"), *args], capture_output=True, text=True, timeout=240,
        env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


@pytest.mark.launch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["csv", "parquet", "directory"])
def test_reading_through_datasets_in_a_worker_leaves_no_semaphore(tmp_path: Path, kind: str) -> None:
    """`datasets` would make tqdm's multiprocessing lock in the worker, whose `os._exit` never releases it:
    the resource tracker would warn at the trainer's exit, after a good read and after a refusal alike."""
    datasets = pytest.importorskip("datasets")
    good = datasets.Dataset.from_list([ROW, {"prompt": "What is 2 + 2?", "answer": "4"}])
    bad = datasets.Dataset.from_list([ROW, {"prompt": "", "answer": "4"}])
    paths = []
    for name, table in (("good", good), ("bad", bad)):
        if kind == "csv":
            table.to_csv(str(tmp_path / f"{name}.csv"), index=False)
            paths.append(str(tmp_path / f"{name}.csv"))
        elif kind == "parquet":
            table.to_parquet(str(tmp_path / f"{name}.parquet"))
            paths.append(str(tmp_path / f"{name}.parquet"))
        else:
            (tmp_path / name).mkdir()
            table.to_csv(str(tmp_path / name / "train.csv"), index=False)
            paths.append(str(tmp_path / name))
    err = _stderr(tmp_path, TRACKER_PROBE, *paths)
    assert "bad" in err and "row 2: " in err  # the refusal happened, in its worker
    assert "resource_tracker" not in err and "leaked" not in err, err


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_the_negative_control_a_leaked_semaphore_is_seen(tmp_path: Path) -> None:
    """The check above can fail: a spawned child that makes a multiprocessing lock and ends with
    `os._exit`, as a worker does, makes the tracker warn."""
    assert "resource_tracker" in _stderr(tmp_path, LEAKING_PROBE)
