"""`treetrain eval` on a damaged run: a checkpoint or final/ whose weights are truncated, random, of another
model, or not a file, and a run whose config.yaml is garbage or missing. Each is one line naming the file,
exit status 2, answered from the files' headers before torch loads (so in about a second), in a fresh
interpreter through the real entry point."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from support.eval_runs import ROOT, eval_in_one_process
from support.hostile_corpus import damaged_weights

from treetrain.train.config import dump_config, load_config

ASSETS = ROOT / "treetrain" / "assets"
WEIGHTS = ASSETS / "demo_model" / "model.safetensors"


def _run(root: Path, name: str, config: str | None = None) -> Path:
    """A run directory with one checkpoint (the demo's weights) and a final/ (a copy of the demo model)."""
    run = root / name
    (run / "checkpoints" / "update-00001").mkdir(parents=True)
    shutil.copy(WEIGHTS, run / "checkpoints" / "update-00001" / "model.safetensors")
    shutil.copytree(ASSETS / "demo_model", run / "final")
    if config is None:
        config = dump_config(load_config(None, [f"run_dir={run}"]))
    (run / "config.yaml").write_text(config)
    return run


def _damaged(root: Path) -> dict[str, tuple[Path, tuple[str, str]]]:
    """Case -> (the --model directory, what its one line must say): every damage of the hostile corpus, in
    a checkpoint and in final/, a FIFO for the weights, and a run config that is garbage or missing."""
    cases = {}
    other = (ASSETS / "demo_model_wide" / "model.safetensors").read_bytes()
    damages = damaged_weights(WEIGHTS.read_bytes(), other)
    for k, (damage, blob) in enumerate(sorted({**damages, "fifo": b""}.items())):
        run = _run(root, f"damage{k:02d}")
        for where in ("checkpoints/update-00001", "final"):
            file = run / where / "model.safetensors"
            file.unlink()
            if damage == "fifo":
                os.mkfifo(file)
            else:
                file.write_bytes(blob)
            wanted = {
                "another model's weights": "does not hold weights of the run's model (demo): model.",
                "fifo": "is not a regular file (a FIFO",
            }.get(damage, "not a complete safetensors file")
            cases[f"{damage} {where.split('/')[0]}"] = (run / where, (str(file), wanted))
    garbage = _run(root, "garbage", config="{{{ not: [yaml\n")
    cases["garbage config.yaml"] = (
        garbage / "checkpoints" / "update-00001",
        (f"--model: config file {garbage / 'config.yaml'}", "not valid YAML"),
    )
    missing = _run(root, "missing")
    (missing / "config.yaml").unlink()
    cases["missing config.yaml"] = (
        missing / "checkpoints" / "update-00001",
        (f"{missing / 'config.yaml'} does not exist", "settings"),
    )
    return cases


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_damaged_checkpoint_is_one_line_before_torch_loads(tmp_path: Path) -> None:
    cases = _damaged(tmp_path)
    argvs = {
        name: ["--model", str(d), "--env", "calculator", "--tasks", "1"] for name, (d, _) in cases.items()
    }
    start = time.perf_counter()
    runs = eval_in_one_process(argvs, tmp_path)
    blocks = runs.stderr.split("--- ")
    for (name, (_, wanted)), block in zip(cases.items(), blocks):
        lines = [line for line in block.splitlines() if line.strip()]
        lines = [line for line in lines if not line.startswith(tuple(cases))]  # the previous block's marker
        assert len(lines) == 1 and lines[0].startswith("treetrain eval: --model: "), (name, block)
        assert all(part in lines[0] for part in wanted), (name, lines[0])
        assert "--resume" not in lines[0], (name, lines[0])
        assert runs.codes[name] == 2, (name, runs.codes)
    assert runs.torch is False  # every case was answered from the headers, before torch loads
    assert max(runs.seconds.values()) < 3.0, (
        runs.seconds
    )  # each answered in under 3 s (in about 0.1 s once the CLI has imported)
    assert time.perf_counter() - start < 60 + 3 * len(cases)


def test_intact_weights_pass_the_header_check(tmp_path: Path) -> None:
    """The negative control: the same files, undamaged, pass (and a checkpoint of a run with a LoRA-wrapped
    layout, whose names differ, is left to the loader)."""
    from treetrain.train.config import ModelSection
    from treetrain.train.eval_weights import check_weight_files

    run = _run(tmp_path, "intact")
    check_weight_files([run / "checkpoints" / "update-00001" / "model.safetensors"], ModelSection())
    check_weight_files(sorted((run / "final").glob("*.safetensors")), ModelSection())
    check_weight_files(sorted((run / "final").glob("*.safetensors")), None)
    check_weight_files([WEIGHTS], ModelSection(path="tiny-llama"))  # a preset has no files to compare with
