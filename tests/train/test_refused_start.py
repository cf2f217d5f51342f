"""Refusals at the start of a run: one line, before any model loads where the input alone decides, and a
run that never started leaves nothing behind. Inputs that could hang (a `--trees` glob over a symlink loop)
end, and a tree file is written only when its own reader accepts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import treetrain.train.models as models
from treetrain.cli.main import main
from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree.build import build_tree
from treetrain.tree.format import save_tree

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--set",
    "model.path=tiny-llama",
    "--set",
    "updates=1",
    "--set",
    "measure_memory_every=0",
    "--no-progress",
]


def _trees_without_logprobs(directory: Path) -> Path:
    prompt = Segment(Role.PROMPT, tuple(range(1, 9)))
    trajs = [
        Trajectory(f"t{i}", (Call((prompt, Segment(Role.POLICY, (10 + i, 11)))),), float(i % 2))
        for i in range(4)
    ]
    directory.mkdir()
    save_tree(build_tree(trajs), directory / "g.msgpack")
    return directory


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    return err


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("loss.ratio_source=sampler", "loss.ratio_source"),
        ("loss.sampler_correction=token_truncate", "loss.sampler_correction"),
        ("loss.sampler_correction=sequence_mask", "loss.sampler_correction"),
    ],
)
def test_sampler_logprobs_needed_on_trees_without_them_is_one_line_before_any_model_loads(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, setting: str, field: str
) -> None:
    trees = _trees_without_logprobs(tmp_path / "trees")
    built: list[object] = []
    monkeypatch.setattr(models, "_load", lambda *a, **k: built.append(a))  # a model load would be recorded
    run = tmp_path / "run"
    argv = ["train", "--run-dir", str(run), "--trees", str(trees), *TINY]
    assert main([*argv, "--set", setting]) == 2
    err = _one_line(capsys)
    assert f"{field}:" in err and "without them" in err and "g.msgpack" in err
    assert built == []
    assert not run.exists(), "a run that never started must leave nothing"


def test_sampler_ratio_negative_control_scoring_gets_past_the_check(tmp_path: Path, capsys) -> None:
    trees = _trees_without_logprobs(tmp_path / "trees")
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--trees", str(trees), *TINY]) == 0, capsys.readouterr().err
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert (
        row["sampler_logprob_gap_mean"] is None and row["sampler_logprob_gap_max"] is None
    )  # nothing to compare
    assert row["sampler_corrected_fraction"] is None  # and no correction


@pytest.mark.parametrize("existing", [False, True])
def test_a_run_refused_at_its_first_update_leaves_nothing(tmp_path: Path, capsys, existing: bool) -> None:
    """`memory_budget=1B` is refused by the planner after rollouts were written; the run never completed an
    update, so its marker, lock, config.yaml and rollouts go, and the one line says so."""
    run = tmp_path / "run"
    if existing:
        run.mkdir()
    small = ["rollout.groups_per_update=1", "rollout.fanout.root=2", "rollout.episode.max_turns=1",
             "rollout.episode.max_turn_tokens=4", "advantages.zero_variance=keep", "memory_budget=1B"]  # fmt: skip
    assert main(["train", "--run-dir", str(run), *TINY, *[a for kv in small for a in ("--set", kv)]]) == 2
    err = _one_line(capsys)
    assert "the run never started" in err
    if existing:
        assert run.is_dir() and list(run.iterdir()) == [] and "nothing of it was left" in err
    else:
        assert not run.exists() and "removed again" in err


def test_a_trees_glob_over_a_symlink_loop_ends(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    for name in ("loop", "loop2"):
        (data / "a" / name).symlink_to("..")
    (data / "a" / "g.msgpack").write_bytes((ROOT / "trees" / "tool_use.msgpack").read_bytes())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    argv = ["train", "--run-dir", str(tmp_path / "run"), "--trees", f"{data}/**/*.msgpack", *TINY]
    done = subprocess.run(
        [sys.executable, "-m", "treetrain", *argv], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        "outside the model's vocabulary" in done.stderr.strip().splitlines()[-1]
    )  # listed, then read: it ended


def _comb_jsonl(path: Path, n: int) -> Path:
    rows = [
        {"trajectory_id": f"t{k}", "group_id": "g", "prompt_token_ids": [2] * (k + 1), "response_token_ids": [1],
         "reward": float(k % 2)}
        for k in range(n)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_import_never_writes_a_tree_file_its_reader_refuses(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    jsonl = _comb_jsonl(tmp_path / "comb.jsonl", 1500)
    assert main(["import", str(jsonl), "--out", str(out), "--group-by", "group_id"]) != 0
    err = _one_line(capsys)
    assert "not written" in err and "reader would refuse" in err
    assert not out.exists() or list(out.iterdir()) == []


def test_import_of_a_small_comb_writes_a_file_inspect_reads(tmp_path: Path, capsys) -> None:
    """Negative control: the same shape within the limits is written and read back."""
    out = tmp_path / "out"
    assert (
        main(
            [
                "import",
                str(_comb_jsonl(tmp_path / "comb.jsonl", 100)),
                "--out",
                str(out),
                "--group-by",
                "group_id",
            ]
        )
        == 0
    )
    [written] = list(out.iterdir())
    capsys.readouterr()
    assert main(["inspect", str(written)]) == 0


def test_a_forced_mode_refuses_a_budget_it_cannot_meet(tmp_path: Path, capsys) -> None:
    """`mode=tree` with a `memory_budget` below tree's smallest predicted peak is refused at the plan, in one
    line naming the peak, the budget and what to change, instead of replaying into an out-of-memory error."""
    trees = _trees_without_logprobs(tmp_path / "trees")
    run = tmp_path / "run"
    argv = ["train", "--run-dir", str(run), "--trees", str(trees), *TINY, "--set", "mode=tree"]
    assert main([*argv, "--set", "memory_budget=4KiB"]) == 2
    err = _one_line(capsys)
    assert "mode=tree was forced, and its smallest predicted peak" in err, err
    assert "exceeds memory_budget 4.0 KiB: raise memory_budget to at least" in err, err
    assert main([*argv, "--set", "memory_budget=4GiB"]) == 0, capsys.readouterr().err  # the control: it fits
