"""Every CLI verb against hostile input of our own making (tests/support/hostile_corpus.py): a non-zero exit, a
one-line error naming the file, never a traceback or a hang (each test has a timeout). The verbs run
in-process (`main(argv)`); two cases go through the real `python -m treetrain` entry point (the verbs that
do not import torch, so that they stay fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from support.hostile_corpus import (
    corrupt_tree_files,
    hostile_jsonl,
    hostile_task_files,
    out_of_range_tree_files,
)
from support.tree_samples import TINY_BYTES

from treetrain.cli.main import main

TRAIN = [
    "--no-progress", "--set", "model.path=tiny-llama", "--set", "rollout.groups_per_update=1",
    "--set", "updates=1", "--set", "measure_memory_every=0",
]  # fmt: skip
PLAN = ["--model", "tiny-llama", "--budget", "64MiB"]
DEMO = str(Path(__file__).resolve().parents[2] / "treetrain" / "assets" / "demo_model")


def run_cli(capsys: pytest.CaptureFixture[str], argv: Sequence[str]) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `treetrain ARGV`, run in this process."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(result: tuple[int, str, str], verb: str, name: str, case: str) -> str:
    """Non-zero, no traceback, and a last line `treetrain VERB: ...` naming the file; returns that line."""
    code, out, err = result
    assert code != 0, f"{case}: exit status 0"
    assert "Traceback" not in out + err, f"{case}: traceback\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"treetrain {verb}"), f"{case}: {err!r}"
    assert name in lines[-1], f"{case}: the error does not name {name}: {lines[-1]}"
    return lines[-1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus")
    paths = {}
    for k, (case, blob) in enumerate(sorted(corrupt_tree_files().items())):
        paths[case] = root / f"case{k:03d}.msgpack"
        paths[case].write_bytes(blob)
    return paths


@pytest.mark.timeout(120)
def test_inspect_and_plan_refuse_every_corrupt_tree_file(
    corpus: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    for case, path in corpus.items():
        assert_refused(run_cli(capsys, ["inspect", str(path)]), "inspect", path.name, case)
        assert_refused(run_cli(capsys, ["inspect", "--json", str(path)]), "inspect", path.name, case)
        assert_refused(run_cli(capsys, ["plan", str(path), *PLAN]), "plan", path.name, case)


@pytest.mark.timeout(180)
def test_train_refuses_corrupt_tree_files(
    corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every tenth case: each costs a tokenizer load before the trees are read."""
    for k, (case, path) in enumerate(sorted(corpus.items())[::10]):
        argv = ["train", "--trees", str(path), "--run-dir", str(tmp_path / f"run{k}"), *TRAIN]
        assert_refused(run_cli(capsys, argv), "train", path.name, case)


@pytest.mark.timeout(120)
def test_out_of_range_token_ids_are_refused_before_a_model_is_sized(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for k, (case, (blob, token)) in enumerate(sorted(out_of_range_tree_files().items())):
        path = tmp_path / f"ids{k}.msgpack"
        path.write_bytes(blob)
        line = assert_refused(run_cli(capsys, ["plan", str(path), *PLAN]), "plan", path.name, case)
        assert str(token) in line
        line = assert_refused(
            run_cli(capsys, ["plan", str(path), *PLAN, "--vocab", "64"]), "plan", path.name, case
        )
        assert f"token id {token} is outside the model's vocabulary of 64" in line
        argv = ["train", "--trees", str(path), "--run-dir", str(tmp_path / f"run{k}"), *TRAIN]
        assert str(token) in assert_refused(run_cli(capsys, argv), "train", path.name, case)
        code, _, err = run_cli(capsys, ["inspect", str(path)])  # a valid file: inspect shows it
        assert code == 0 and "Traceback" not in err


@pytest.mark.timeout(120)
def test_a_tree_given_twice_is_refused_naming_its_trajectories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tiny.msgpack"
    path.write_bytes(TINY_BYTES)
    line = assert_refused(run_cli(capsys, ["plan", str(path), str(path), *PLAN]), "plan", path.name, "twice")
    assert "'a', 'b', 'c'" in line and "trained twice" in line
    copy = tmp_path / "dir" / "copy.msgpack"
    copy.parent.mkdir()
    copy.write_bytes(TINY_BYTES)
    (copy.parent / "again.msgpack").write_bytes(TINY_BYTES)
    argv = ["train", "--trees", str(copy.parent), "--run-dir", str(tmp_path / "run"), *TRAIN]
    assert "'a', 'b', 'c'" in assert_refused(run_cli(capsys, argv), "train", "copy.msgpack", "two copies")


@pytest.mark.timeout(60)
def test_missing_and_unreadable_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.msgpack")
    assert_refused(run_cli(capsys, ["inspect", missing]), "inspect", missing, "missing")
    assert_refused(run_cli(capsys, ["plan", missing, *PLAN]), "plan", missing, "missing")
    assert_refused(run_cli(capsys, ["inspect", str(tmp_path)]), "inspect", str(tmp_path), "a directory")
    out = str(tmp_path / "out")
    assert_refused(run_cli(capsys, ["import", missing, "--out", out]), "import", missing, "missing")


@pytest.mark.timeout(120)
def test_import_refuses_hostile_jsonl_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for k, (case, blob) in enumerate(sorted(hostile_jsonl().items())):
        path = tmp_path / f"case{k:03d}.jsonl"
        path.write_bytes(blob)
        out = tmp_path / f"out{k}"
        assert_refused(run_cli(capsys, ["import", str(path), "--out", str(out)]), "import", path.name, case)
        assert not out.exists(), f"{case}: wrote {out}"


@pytest.mark.timeout(120)
def test_the_real_entry_point_answers_hostile_input_in_one_line(tmp_path: Path) -> None:
    tree = tmp_path / "flipped.msgpack"
    tree.write_bytes(corrupt_tree_files()["truncated at 1"])
    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_bytes(hostile_jsonl()["deeply nested metadata"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    for verb, argv in [
        ("inspect", ["inspect", str(tree)]),
        ("import", ["import", str(jsonl), "--out", str(tmp_path / "out")]),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "treetrain", *argv], capture_output=True, text=True, timeout=100, env=env
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stdout + done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"treetrain {verb}: ")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifos_and_devices_are_refused_without_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO would block `open` forever and /dev/zero never ends (a tree file would be read to its 2 GiB
    limit): every verb refuses anything but a regular file before reading a byte."""
    fifo = tmp_path / "fifo.msgpack"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.msgpack"
    zero.symlink_to("/dev/zero")
    for path in (str(fifo), str(zero)):
        for verb, argv in [
            ("inspect", ["inspect", path]),
            ("plan", ["plan", path, *PLAN]),
            ("import", ["import", path, "--out", str(tmp_path / "out")]),
        ]:
            line = assert_refused(run_cli(capsys, argv), verb, path, f"{verb} {path}")
            assert "not a regular file" in line
        argv = ["train", "--trees", path, "--run-dir", str(tmp_path / "run"), *TRAIN]
        assert_refused(run_cli(capsys, argv), "train", path, f"train {path}")
        task_file = [f"env.kwargs.path={path}", "env.kwargs.eval_fraction=0.5"]
        argv = ["eval", "--model", DEMO, "--env", "dataset", *(a for kv in task_file for a in ("--set", kv))]
        line = assert_refused(run_cli(capsys, argv), "eval", path, f"eval {path}")
        assert "not a regular file" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_eval_refuses_hostile_task_files_naming_file_and_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dataset environment's task file (NaN and infinite numbers, rows of the wrong shape), read when
    `treetrain eval` makes the environment, before any model loads."""
    for k, (case, blob) in enumerate(sorted(hostile_task_files().items())):
        path = tmp_path / f"tasks{k:02d}.jsonl"
        path.write_bytes(blob)
        task_file = [f"env.kwargs.path={path}", "env.kwargs.eval_fraction=0.5"]
        argv = ["eval", "--model", DEMO, "--env", "dataset", *(a for kv in task_file for a in ("--set", kv))]
        line = assert_refused(run_cli(capsys, argv), "eval", path.name, case)
        assert "row 2: " in line, (case, line)


@pytest.mark.timeout(120)
def test_a_trajectory_of_thousands_of_calls_imports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trajectory checks are linear in its calls: 4,000 calls of one trajectory (which a quadratic
    ownership check took minutes over) import, and the file loads again."""
    row = {"trajectory_id": "t", "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5]}
    lines = [json.dumps({**row, "call_index": i, **({"reward": 1.0} if i == 0 else {})}) for i in range(4000)]
    src = tmp_path / "calls.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code, out, err = run_cli(capsys, ["import", str(src), "--out", str(tmp_path / "out")])
    assert code == 0, err
    (tree_file,) = (tmp_path / "out").glob("*.msgpack")
    code, out, err = run_cli(capsys, ["inspect", "--json", str(tree_file)])
    assert code == 0, err
    assert json.loads(out)["trees"][0]["stats"]["num_calls"] == 4000


@pytest.mark.timeout(60)
def test_a_reader_that_leaves_early_is_not_an_error(tmp_path: Path) -> None:
    """`treetrain inspect FILE | head`: stdout closed under the writer ends quietly (141), no traceback."""
    tree = tmp_path / "tiny.msgpack"
    tree.write_bytes(TINY_BYTES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "treetrain", "inspect", str(tree)],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=50, env=env,
        )  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""


@pytest.mark.timeout(120)
def test_a_diverged_step_ends_train_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-finite gradient (huge but in-range coefficients can still overflow) is refused by the backend;
    `treetrain train` says so in one line instead of a traceback."""
    from treetrain.distributed.backend import TorchBackend

    def diverged(self: TorchBackend) -> bool:
        raise FloatingPointError("gradient norm is nan; the step is refused and the window discarded")

    monkeypatch.setattr(TorchBackend, "step", diverged)
    tree = tmp_path / "tiny.msgpack"
    tree.write_bytes(TINY_BYTES)
    argv = ["train", "--trees", str(tree), "--run-dir", str(tmp_path / "run"), *TRAIN]
    line = assert_refused(run_cli(capsys, argv), "train", "gradient norm is nan", "diverged")
    assert line.startswith("treetrain train: gradient norm is nan")


@pytest.mark.timeout(120)
def test_outputs_never_replace_a_fifo_or_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An atomic write renames over its target: over a device, a FIFO or a socket that would put a file
    where it was (as root, `--dot /dev/null` replaced /dev/null). Only regular files are replaced."""
    tree = tmp_path / "tiny.msgpack"
    tree.write_bytes(TINY_BYTES)
    targets = [tmp_path / "a-directory"]
    targets[0].mkdir()
    if hasattr(os, "mkfifo"):
        targets.append(tmp_path / "fifo.dot")
        os.mkfifo(targets[1])
    for target in targets:
        line = assert_refused(
            run_cli(capsys, ["inspect", str(tree), "--dot", str(target)]), "inspect", str(target), "dot"
        )
        assert "refusing to replace it" in line
    assert targets[0].is_dir() and all(not t.is_file() for t in targets)


@pytest.mark.timeout(120)
def test_tree_paths_the_file_system_refuses_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loop = tmp_path / "loop.msgpack"
    loop.symlink_to(loop)
    long = str(tmp_path / ("z" * 300))
    for path in (str(loop), long, long + "/*.msgpack"):
        argv = ["train", "--trees", path, "--run-dir", str(tmp_path / "run"), *TRAIN]
        code, _, err = run_cli(capsys, argv)
        assert code == 2 and "Traceback" not in err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        last = lines[-1]  # a path that cannot be a tree source is a config error, found before torch loads
        assert last.startswith("treetrain train: ") and "rollout.trees: " in last and len(last) < 600, last[
            :300
        ]


def test_a_preset_the_allocator_refuses_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preset that the allocator refuses (a large `--vocab` on a machine with little memory) is one line."""
    import treetrain.models.presets as presets

    def refused(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes"
        )

    monkeypatch.setattr(presets, "tiny_model", refused)
    tree = str(Path(__file__).parents[1] / "assets" / "tree_tiny.msgpack")
    line = assert_refused(
        run_cli(capsys, ["plan", tree, *PLAN, "--vocab", str(1 << 20)]), "plan", "tiny-llama", "alloc"
    )
    assert "can't allocate memory" in line


@pytest.mark.timeout(60)
def test_run_dirs_the_file_system_refuses_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "tiny.msgpack"
    tree.write_bytes(TINY_BYTES)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for run_dir in (str(tmp_path / ("q" * 300)), str(loop / "sub")):
        argv = ["train", "--trees", str(tree), "--run-dir", run_dir, *TRAIN]
        line = assert_refused(run_cli(capsys, argv), "train", "--run-dir", run_dir[-20:])
        assert "cannot" in line


def test_a_vocab_that_would_take_gibs_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    tree = str(Path(__file__).parents[1] / "assets" / "tree_tiny.msgpack")
    code, _, err = run_cli(capsys, ["plan", tree, *PLAN, "--vocab", str(1 << 24)])
    assert code == 2 and "Traceback" not in err and "must be in [1, 1048576]" in err


def _numeric_options() -> list[tuple[str, str, object]]:
    """(verb, option, argparse type) for every option of every verb that takes a number."""
    import argparse

    from treetrain.cli.main import build_parser

    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for verb, parser in verbs.choices.items():
        for action in parser._actions:
            if action.type is not None and action.option_strings:
                found.append((verb, action.option_strings[-1], action.type))
    return found


def test_every_numeric_option_is_checked_like_a_config_field() -> None:
    """argparse's bare `int` and `float` take nan, inf and 2**63: no verb may use them (choices aside)."""
    from treetrain.cli.option_types import Real, Whole

    typed = [(verb, opt) for verb, opt, kind in _numeric_options() if isinstance(kind, Whole | Real)]
    bare = [(verb, opt) for verb, opt, kind in _numeric_options() if kind in (int, float)]
    assert bare == [("plan", "--zero-stage")], bare  # the one with choices (0, 1, 2, 3)
    assert {("plan", "--min-speedup"), ("plan", "--world-size"), ("inspect", "--max-tokens")} <= set(typed)
    assert ("plan", "--context-parallel") in typed
    assert ("train", "--updates") in typed and len(typed) >= 7


def _hostile_numbers(kind: object) -> list[str]:
    from treetrain.cli.option_types import Real, Whole

    common = ["nan", "NaN", "inf", "-inf", "1e400", "-1e400", "", " ", "x", "0x10"]
    if isinstance(kind, Whole):
        return [*common, str(kind.low - 1), str(kind.high + 1), str(2**63), "9" * 5000, "1_0", "2**63",
                "1.5", "1e3", "\uff12"]  # fmt: skip
    assert isinstance(kind, Real)
    return [
        *common,
        repr(kind.low - 1),
        repr(kind.high * 2),
        "-5",
        *([repr(kind.low)] if kind.low_open else []),
    ]


@pytest.mark.timeout(120)
def test_every_numeric_option_refuses_out_of_range_and_non_finite_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each is refused at parse time in argparse's one line naming the option (before anything loads);
    a value in range parses (the negative control)."""
    from treetrain.cli.main import build_parser
    from treetrain.cli.option_types import Real, Whole

    needs = {
        "plan": ["t.msgpack"],
        "inspect": ["t.msgpack"],
        "train": [],
        "import": ["in.jsonl", "--out", "o"],
        "eval": ["--model", "m", "--env", "calculator"],
    }
    for verb, opt, kind in _numeric_options():
        if not isinstance(kind, Whole | Real):
            continue
        for value in _hostile_numbers(kind):
            code, _, err = run_cli(capsys, [verb, *needs[verb], f"{opt}={value}"])
            last = err.strip().splitlines()[-1] if err.strip() else ""
            assert code == 2 and "Traceback" not in err, f"{verb} {opt}={value!r}: {code} {err[-500:]}"
            assert last.startswith(f"treetrain {verb}: error: argument {opt}"), f"{opt}={value!r}: {last}"
        fine = str(kind.high) if isinstance(kind, Whole) else repr(kind.high)
        args = build_parser().parse_args([verb, *needs[verb], f"{opt}={fine}"])
        assert getattr(args, opt.lstrip("-").replace("-", "_")) == (
            int(fine) if isinstance(kind, Whole) else kind.high
        )
    for value in ("nan", "inf", "-5"):  # the outside checks' own cases
        code, _, err = run_cli(capsys, ["plan", "t.msgpack", *PLAN, "--min-speedup", value])
        assert code == 2 and "argument --min-speedup" in err
    code, _, err = run_cli(capsys, ["plan", "t.msgpack", *PLAN, "--world-size", str(2**63)])
    assert code == 2 and "argument --world-size: must be in [1, 65536]" in err
    code, _, err = run_cli(capsys, ["plan", "t.msgpack", *PLAN, "--context-parallel", "0"])
    assert code == 2 and "argument --context-parallel: must be in [1, 1024]" in err
