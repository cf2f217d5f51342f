"""Trees are checked before any model is built or sized: token ids against the vocabulary read from the
model's config (`train --trees`, `plan --config`), and trajectory ids unique within a group (every verb
that loads a file). Each refusal is one line naming the file, the trajectory and the id."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from treetrain.cli.main import main
from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree.build import build_tree
from treetrain.tree.format import TreeFormatError, load_trees, save_trees, trees_from_bytes, trees_to_bytes

TRAIN = [
    "--no-progress", "--set", "model.path=tiny-llama", "--set", "rollout.groups_per_update=1",
    "--set", "updates=1", "--set", "measure_memory_every=0",
]  # fmt: skip


def trajectory(tid: str, *tokens: int) -> Trajectory:
    call = Call((Segment(Role.PROMPT, (1, *tokens)), Segment(Role.POLICY, (3,))))
    return Trajectory(tid, (call,), reward=1.0)


def run_cli(capsys: pytest.CaptureFixture[str], argv: Sequence[str]) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) >= 1
    return code, lines[-1]


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building or sizing any model fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was built before the trees were checked")

    monkeypatch.setattr("treetrain.train.models._load", refuse)
    monkeypatch.setattr("treetrain.models.presets.load_model", refuse)


@pytest.mark.parametrize("token", [70_000, 2**32 - 1])
def test_train_trees_refuses_ids_outside_the_vocabulary_before_a_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None, token: int
) -> None:
    path = tmp_path / "alien.msgpack"
    save_trees([build_tree([trajectory("ok", 4), trajectory("alien-7", 5, token)])], path)
    argv = ["train", "--trees", str(path), "--run-dir", str(tmp_path / "run"), *TRAIN]
    code, line = run_cli(capsys, argv)
    assert code == 2
    assert line.startswith("treetrain train: rollout.trees: ")
    assert str(path) in line and f"token id {token} is outside" in line and "'alien-7'" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_plan_config_refuses_ids_outside_the_vocabulary_before_a_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    path = tmp_path / "alien.msgpack"
    save_trees([build_tree([trajectory("alien-9", 5, 2**32 - 1)])], path)
    for extra in (["--set", "model.path=tiny-llama"], ["--config", str(tmp_path / "c.toml")]):
        (tmp_path / "c.toml").write_text('[model]\npath = "tiny-llama"\n')
        code, line = run_cli(capsys, ["plan", str(path), "--budget", "64MiB", *extra])
        assert code == 2
        assert line.startswith(f"treetrain plan: {path}: token id 4294967295 is outside")
        assert "'alien-9'" in line


def test_plan_preset_names_the_trajectory_of_a_too_large_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    path = tmp_path / "alien.msgpack"
    save_trees([build_tree([trajectory("alien-3", 5, 2**32 - 1)])], path)
    code, line = run_cli(capsys, ["plan", str(path), "--model", "tiny-llama", "--budget", "64MiB"])
    assert code == 2 and "token id 4294967295 (in trajectory 'alien-3') is too large" in line


def test_a_trajectory_id_in_two_trees_of_a_group_is_refused_at_load() -> None:
    first = build_tree([trajectory("a", 4), trajectory("shared-id", 5)])
    second = build_tree([trajectory("b", 6), trajectory("shared-id", 7)])
    blob = trees_to_bytes([first, second])
    with pytest.raises(TreeFormatError) as info:
        trees_from_bytes(blob)
    assert str(info.value) == (
        "trees[1].trajectories[1].id: 'shared-id' is also the id of a trajectory in trees[0]; "
        "trajectory ids must be unique within a group"
    )
    assert len(trees_from_bytes(trees_to_bytes([first, build_tree([trajectory("b", 6)])]))) == 2


def test_every_verb_refuses_a_group_with_a_repeated_trajectory_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dup.msgpack"
    group = [build_tree([trajectory("x", 4)]), build_tree([trajectory("x", 5)])]
    with pytest.raises(
        TreeFormatError, match=r"not written, its reader would refuse it: .*'x' is also the id"
    ):
        save_trees(group, path)  # the writer refuses what its reader would
    assert not path.exists()
    path.write_bytes(trees_to_bytes(group))  # written by hand, as another program might
    with pytest.raises(TreeFormatError, match="'x' is also the id"):
        load_trees(path)
    argvs = {
        "inspect": ["inspect", str(path)],
        "plan": ["plan", str(path), "--model", "tiny-llama", "--budget", "64MiB"],
        "train": ["train", "--trees", str(path), "--run-dir", str(tmp_path / "run"), *TRAIN],
    }
    for verb, argv in argvs.items():
        code, line = run_cli(capsys, argv)
        assert code == 2, verb
        assert line.startswith(f"treetrain {verb}") and str(path) in line and "'x' is also the id" in line
