"""Every verb's path arguments answer the same classes of mistake in one line, in the same words: a path
that does not exist, a directory where a file is expected (or the other way round), a file of the wrong
kind. Config mistakes are answered before torch is imported (checked in a fresh interpreter), and
`inspect` takes several files, directories and run directories, with its own usage on a bad option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from treetrain.cli.main import main
from treetrain.train.config import load_config

REPO = Path(__file__).resolve().parents[2]
TREES = REPO / "trees"
TOOL_USE = TREES / "tool_use.msgpack"
README = REPO / "README.md"
SAFETENSORS = REPO / "treetrain" / "assets" / "demo_model" / "model.safetensors"
JSONL = Path(__file__).parents[1] / "assets" / "import_sample.jsonl"
PLAN = ["--model", "tiny-llama", "--budget", "64MiB"]


def one_line(capsys: pytest.CaptureFixture[str], argv: Sequence[str]) -> tuple[int, str]:
    """Exit status and the only stderr line of `treetrain ARGV`; fails on a traceback or a second line."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in out + err, err
    assert len(lines) == 1, err
    return code, lines[0]


def _cases(tmp: Path) -> list[tuple[list[str], str, str]]:
    """(argv, verb, what the line must say) for each verb and each class of mistake."""
    missing, empty = tmp / "missing", tmp / "empty"
    return [
        # a path that does not exist
        (["inspect", str(missing)], "inspect", f"'{missing}' does not exist"),
        (["plan", str(missing), *PLAN], "plan", f"'{missing}' does not exist"),
        (["import", str(missing), "--out", str(tmp / "o")], "import", f"'{missing}' does not exist"),
        (["train", "--config", str(missing / "c.yaml")], "train", f"'{missing / 'c.yaml'}' does not exist"),
        (["plan", str(TOOL_USE), "--budget", "1GiB", "--config", str(missing)], "plan", "does not exist"),
        (["inspect", str(TOOL_USE), "--tokenizer", str(missing)], "inspect", f"'{missing}' does not exist"),
        (
            ["inspect", str(TOOL_USE), "--dot", str(missing / "t.dot")],
            "inspect",
            f"'{missing}' does not exist",
        ),
        (["train", "--set", f"model.path={missing}"], "train", f"model.path: '{missing}' does not exist"),
        (["train", "--set", f"model.tokenizer={missing}"], "train", f"model.tokenizer: '{missing}' does not"),
        (["train", "--trees", str(missing)], "train", f"rollout.trees: '{missing}' does not exist"),
        # a directory where a file is expected, a file where a directory is
        (["import", str(TREES), "--out", str(tmp / "o")], "import", f"'{TREES}' is a directory, not a file"),
        (["train", "--config", str(TREES)], "train", f"'{TREES}' is a directory, not a file"),
        (["inspect", str(TOOL_USE), "--dot", str(TREES)], "inspect", "a directory; refusing to replace it"),
        (["inspect", str(TOOL_USE), "--tokenizer", str(README)], "inspect", "is a file, not a directory"),
        (["import", str(JSONL), "--out", str(README)], "import", f"'{README}' is a file, not a directory"),
        (["train", "--set", f"model.tokenizer={README}"], "train", f"'{README}' is a file, not a directory"),
        (["inspect", str(empty)], "inspect", f"no *.msgpack tree files under '{empty}'"),
        (["plan", str(empty), *PLAN], "plan", f"no *.msgpack tree files under '{empty}'"),
        # a file of the wrong kind
        (
            ["inspect", str(README)],
            "inspect",
            "README.md: file: not a treetrain tree file (it looks like text",
        ),
        (["inspect", str(SAFETENSORS)], "inspect", "not a treetrain tree file (it looks like a safetensors"),
        (["inspect", str(JSONL)], "inspect", "not a treetrain tree file (it looks like JSON or JSONL"),
        (["plan", str(README), *PLAN], "plan", "README.md: file: not a treetrain tree file"),
        (
            ["train", "--config", str(README)],
            "train",
            "README.md: not a config file; use .toml, .yaml or .yml",
        ),
        (
            ["import", str(README), "--out", str(tmp / "o")],
            "import",
            "README.md:1: field '<json>': invalid JSON",
        ),
    ]


@pytest.mark.timeout(300)
def test_every_path_mistake_is_one_line_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    for argv, verb, needle in _cases(tmp_path):
        code, line = one_line(capsys, argv)
        assert code == 2, (argv, line)
        assert line.startswith(f"treetrain {verb}: "), (argv, line)
        assert needle in line, (argv, line)
        assert "PosixPath" not in line and "Repo id" not in line and "Errno" not in line, line
    assert not (tmp_path / "o").exists()  # nothing was written by a refused import


def _fresh(code: str) -> dict[str, object]:
    """Run `code` in a new interpreter with this worktree first on the path; it prints one JSON object."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


HEAVY = ("torch", "transformers", "peft", "deepspeed")
PROBE = """
import contextlib, io, json, sys
from treetrain.cli.main import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    code = main({argv!r})
print(json.dumps({{"code": code, "err": err.getvalue(), "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


@pytest.mark.launch  # each case answers in a fresh interpreter
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--set", "nosuchkey=1"], "nosuchkey: unknown field"),
        (["train", "--set", "model.lora.r=0"], "model.lora.r: must be in"),
        (["train", "--set", "optim.lr=0"], "optim.lr must be > 0"),
        (["train", "--set", "replay.contract=nope"], "replay.contract"),
        (["train", "--set", "loss.sampler_correction_cap=1"], "loss.sampler_correction_cap: must be"),
        (
            [
                "train",
                "--set",
                "loss.sampler_correction=token_truncate",
                "--set",
                "rollout.sampling.top_p=0.9",
            ],
            "loss.sampler_correction: 'token_truncate'",
        ),
        (["train", "--config", "nope.yaml"], "'nope.yaml' does not exist"),
        (["train", "--set", "model.path=/no/such/model"], "model.path: '/no/such/model' does not exist"),
        (["plan", "trees/tool_use.msgpack", "--budget", "1GiB"], "give --model"),
        (["plan", "trees/tool_use.msgpack", "--budget", "1GiB", "--set", "nosuchkey=1"], "nosuchkey"),
        (["train", "--resume", "--run-dir", "runs/never-ran-here"], "runs/never-ran-here does not exist"),
        (["train", "--resume", "--no-progress", "--run-dir", "trees"], "trees holds no treetrain run"),
        (["plan", "trees/tool_use.msgpack", *PLAN, "--chunk-size", "1"], "units, more than the 512"),
    ],
)
def test_config_errors_are_answered_before_torch_is_imported(argv: list[str], needle: str) -> None:
    result = _fresh(PROBE.format(argv=argv, heavy=HEAVY))
    assert result["code"] == 2 and needle in str(result["err"]), result
    assert result["heavy"] == [], f"imported {result['heavy']} before answering {argv}"


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.launch  # each case answers in a fresh interpreter
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("verb", "sets", "needle"),
    [
        ("train", ["env.name=nosuch"], "unknown environment 'nosuch'"),
        ("train", ["env.name=dataset", "env.kwargs.path={tmp}/missing.jsonl"], "is not a local file"),
        ("train", ["env.name=dataset", "env.kwargs.path={tmp}/bad.jsonl"], "row 2: prompt: must be"),
        ("train", ["env.rubric=nope"], "env.rubric: CalculatorEnv has no rubric 'nope'"),
        ("train", ["eval.every=1", "env.name=dataset", "env.kwargs.path={tasks}"], "no held-out rows"),
        (
            "train",
            ["rollout.engine=vllm-server", 'rollout.vllm.urls=["http://127.0.0.1:{port}"]'],
            "rollout.vllm.urls: no vllm serve answers at http://127.0.0.1:{port} (GET /v1/models: cannot connect",
        ),
        ("train", ["run_dir={tmp}/taken"], "already holds a run"),
        (
            "eval",
            ["rollout.engine=vllm-server", 'rollout.vllm.urls=["http://127.0.0.1:{port}"]'],
            "rollout.vllm.urls: no vllm serve answers at http://127.0.0.1:{port}",
        ),
    ],
)
def test_input_errors_are_answered_before_torch_is_imported(
    tmp_path: Path, verb: str, sets: list[str], needle: str
) -> None:
    """The environment, its task file, the held-out split, the servers and the run directory are checked before
    torch loads: each of these took 8-19 s (torch, the model, then the check) and now takes about one."""
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1 + 1?", "answer": 2}\n{"prompt": 3}\n')
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / ".treetrain-run").write_text('{"schema": "treetrain.run/1"}\n')
    (taken / "config.yaml").write_text("updates: 1\n")
    values = {
        "tmp": str(tmp_path),
        "tasks": str(REPO / "tests" / "assets" / "tasks.jsonl"),
        "port": str(_closed_port()),
    }
    argv = [verb, *(a for s in sets for a in ("--set", s.format(**values)))]
    if verb == "eval":
        argv += ["--model", str(SAFETENSORS.parent), "--env", "calculator"]
    elif not any(s.startswith("run_dir=") for s in sets):  # --run-dir would win over --set run_dir=
        argv += ["--run-dir", str(tmp_path / "run")]
    result = _fresh(PROBE.format(argv=argv, heavy=HEAVY))
    assert result["code"] == 2 and needle.format(**values) in str(result["err"]), result
    assert len(str(result["err"]).strip().splitlines()) == 1, result
    assert result["heavy"] == [], f"imported {result['heavy']} before answering {argv}"
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


@pytest.mark.launch  # a fresh interpreter
def test_the_import_probe_sees_torch_when_it_is_imported() -> None:
    """Negative control: the same probe, on a verb that loads a model, does report torch."""
    argv = ["plan", "trees/tool_use.msgpack", "--budget", "1GiB", "--model", "/no/such"]
    result = _fresh(PROBE.format(argv=argv, heavy=HEAVY))
    assert result["code"] == 2 and "torch" in result["heavy"], result


def test_print_config_does_not_point_a_copy_at_the_demo_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "\nrun_dir:" not in text and text.startswith("# run_dir: runs/demo")
    (tmp_path / "mine.yaml").write_text(text)
    assert load_config(tmp_path / "mine.yaml").run_dir == str(Path("runs") / "mine")
    (tmp_path / "set.yaml").write_text("run_dir: elsewhere\n")  # a file that sets it keeps it
    assert load_config(tmp_path / "set.yaml").run_dir == "elsewhere"
    assert load_config(None).run_dir == "runs/demo"  # no file: the demo's defaults
    assert main(["train", "--print-config", "--run-dir", "runs/x"]) == 0
    assert capsys.readouterr().out.startswith("run_dir: runs/x\n")


def _inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_takes_files_directories_and_run_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shipped = sorted(TREES.glob("*.msgpack"))
    code, out, _ = _inspect(capsys, str(TREES), "--json")
    assert code == 0
    assert [t["file"] for t in json.loads(out)["trees"]] == [str(p) for p in shipped]
    run = tmp_path / "run" / "rollouts" / "update-00000" / "trees"  # a trainer's layout
    run.mkdir(parents=True)
    (run / "g0.msgpack").write_bytes(TOOL_USE.read_bytes())
    code, out, _ = _inspect(capsys, str(tmp_path / "run"), str(TOOL_USE), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["paths"] == [str(tmp_path / "run"), str(TOOL_USE)]
    assert [t["file"] for t in doc["trees"]] == [str(run / "g0.msgpack"), str(TOOL_USE)]
    assert doc["trees"][0]["stats"] == doc["trees"][1]["stats"]
    code, out, _ = _inspect(capsys, str(TREES))
    assert code == 0 and all(f"{p}: tree " in out for p in shipped)  # each outline says whose it is


def test_a_bad_option_shows_the_verbs_own_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for verb, argv in [("inspect", [str(TOOL_USE), "--bogus"]), ("plan", [str(TOOL_USE), *PLAN, "--bogus"])]:
        with pytest.raises(SystemExit) as info:
            main([verb, *argv])
        err = capsys.readouterr().err
        assert info.value.code == 2
        assert err.startswith(f"usage: treetrain {verb} ") and f"treetrain {verb}: error: unrecognized" in err


def test_template_warnings_are_logged_once_per_process(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every episode checks its template; a run of nine episodes logged the same warning nine times."""
    from envs import template

    monkeypatch.setattr(template, "_WARNED", set())
    warn: Callable[[str], None] = template._warn_once
    for _ in range(9):
        warn("the chat template does not show tool schemas to the model")
    warn("another problem")
    messages = [r.getMessage() for r in caplog.records if r.name == "envs.template"]
    assert messages == ["the chat template does not show tool schemas to the model", "another problem"]
