"""`treetrain eval` against bad arguments: each is one line naming the problem, exit status 2, and torch
is never imported (everything a model is not needed for is checked first). Run through the real entry
point in a fresh interpreter, so that "torch was not imported" means something."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.eval_runs import ROOT, eval_in_one_process

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
    "a run directory": (
        ["--model", "RUN", "--env", "calculator"],
        "RUN is a run directory, not a model; score its final model (--model RUN/final) or one of its "
        "checkpoints (--model RUN/checkpoints/update-XXXXX)",
    ),
}


@pytest.mark.timeout(300)
def test_bad_arguments_are_one_line_before_torch_loads(tmp_path: Path) -> None:
    adapters = tmp_path / "final"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text("{}")
    run = tmp_path / "ds"  # a run directory, with its final model
    (run / "final").mkdir(parents=True)
    (run / ".treetrain-run").write_text('{"schema": "treetrain.run/1"}\n')
    (run / "config.yaml").write_text("updates: 1\n")
    (run / "final" / "config.json").write_text("{}")
    places = {"ADAPTERS": str(adapters), "RUN": str(run)}
    argvs = {name: [places.get(a, a) for a in argv] for name, (argv, _) in CASES.items()}
    runs = eval_in_one_process(argvs, tmp_path)
    lines = [line for line in runs.stderr.splitlines() if line.startswith("treetrain eval: ")]
    assert len(lines) == len(CASES), runs.stderr
    for (name, (_, wanted)), line in zip(CASES.items(), lines):
        assert runs.codes[name] == 2, (name, runs.codes)
        assert wanted.replace("RUN", str(run)) in line, (name, line)
    assert runs.torch is False


def test_the_verb_is_listed_and_its_flags_parse(capsys: pytest.CaptureFixture[str]) -> None:
    from treetrain.cli.main import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert "--samples" in out and "--json" in out and "--no-greedy" in out
    with pytest.raises(SystemExit) as caught:
        main(["eval", "--env", "calculator"])  # --model is required
    assert caught.value.code == 2


def test_a_checkpoint_is_scored_as_after_its_own_updates(tmp_path: Path) -> None:
    """`eval --json` on `checkpoints/update-00003/` reports update 3 (its trainer state), `final/` the run's
    last checkpoint when it was exported after it, and a model that is no run's 0."""

    from treetrain.cli.eval import trained_at
    from treetrain.distributed.checkpoint_io import STATE_FILE, write_client_state

    run = tmp_path / "run"
    for update in (2, 3):
        (run / "checkpoints" / f"update-{update:05d}").mkdir(parents=True)
        write_client_state(
            run / "checkpoints" / f"update-{update:05d}", {"update": update, "version": update - 1}
        )
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")
    assert trained_at(run / "checkpoints" / "update-00003") == (3, 2)
    assert trained_at(run / "checkpoints" / "update-00002") == (2, 1)
    assert trained_at(run / "final") == (3, 2)
    assert trained_at(tmp_path / "elsewhere") == (0, 0)
    # the control: a checkpoint newer than final/ (a resume that never finished) is not final/'s
    newest = run / "checkpoints" / "update-00003" / STATE_FILE
    later = (run / "final" / "config.json").stat().st_mtime + 60
    os.utime(newest, (later, later))
    assert trained_at(run / "final") == (0, 0)
