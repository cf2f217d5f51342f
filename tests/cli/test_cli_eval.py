"""`treetrain eval` against bad arguments: each is one line naming the problem, exit status 2, and torch
is never imported (everything a model is not needed for is checked first). Run through the real entry
point in a fresh interpreter, so that "torch was not imported" means something."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASSET = str(ROOT / "tests" / "assets" / "tasks.jsonl")
DEMO = str(ROOT / "treetrain" / "assets" / "demo_model")

CASES = {
    "missing model": (
        ["--model", "/no/such/dir", "--env", "calculator"],
        "--model: '/no/such/dir' does not exist",
    ),
    "not a model": (["--model", str(ROOT / "docs"), "--env", "calculator"], "neither a model directory"),
    "a file as model": (["--model", ASSET, "--env", "calculator"], "--model"),
    "unknown env": (["--model", DEMO, "--env", "nosuch"], "unknown environment 'nosuch'"),
    "zero tasks": (["--model", DEMO, "--env", "calculator", "--tasks", "0"], "--tasks"),
    "huge tasks": (["--model", DEMO, "--env", "calculator", "--tasks", "99999999"], "--tasks"),
    "greedy samples": (["--model", DEMO, "--env", "calculator", "--samples", "4"], "eval.samples"),
    "bad engine": (["--model", DEMO, "--env", "calculator", "--set", "rollout.engine=tgi"], "rollout.engine"),
    "bad rubric": (["--model", DEMO, "--env", "calculator", "--set", "env.rubric=nope"], "env.rubric"),
    "dataset without held-out rows": (
        ["--model", DEMO, "--env", "dataset", "--set", f"env.kwargs.path={ASSET}"],
        "no held-out rows",
    ),
    "dataset from the hub": (
        ["--model", DEMO, "--env", "dataset", "--set", "env.kwargs.path=openai/gsm8k"],
        "not a local file or directory",
    ),
    "lora adapters": (["--model", "ADAPTERS", "--env", "calculator"], "LoRA adapters only"),
}

PROBE = """
import json, sys
from treetrain.cli.main import main
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    try:
        code = main(["eval", *argv])
    except SystemExit as exc:
        code = exc.code
    results[name] = code
print(json.dumps({"codes": results, "torch": "torch" in sys.modules}))
"""


@pytest.mark.timeout(300)
def test_bad_arguments_are_one_line_before_torch_loads(tmp_path: Path) -> None:
    adapters = tmp_path / "final"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text("{}")
    argvs = {
        name: [str(adapters) if a == "ADAPTERS" else a for a in argv] for name, (argv, _) in CASES.items()
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True, text=True, timeout=280, env=env,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("treetrain eval: ")]
    assert len(lines) == len(CASES), done.stderr
    for (name, (_, wanted)), line in zip(CASES.items(), lines):
        assert report["codes"][name] == 2, (name, report)
        assert wanted in line, (name, line)
    assert report["torch"] is False


def test_the_verb_is_listed_and_its_flags_parse(capsys: pytest.CaptureFixture[str]) -> None:
    from treetrain.cli.main import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert "--samples" in out and "--json" in out and "--no-greedy" in out
    with pytest.raises(SystemExit) as caught:
        main(["eval", "--env", "calculator"])  # --model is required
    assert caught.value.code == 2
