"""`treetrain plan --model PATH` without trees: `treetrain train`'s start-up checks, each refusal one line.

Each refusal is tested on a checkpoint built to fail exactly one check, next to one that passes it: a
tokenizer with more ids than the embedding (against a larger embedding, which is fine), a tokenizer
without a chat template, and a model whose RoPE the tree split cannot reproduce."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from treetrain.assets import tokenizer_path
from treetrain.cli.main import main
from treetrain.errors import ConfigError
from treetrain.train.config import ModelSection
from treetrain.train.models import load_models


def _checkpoint(path: Path, vocab: int, chat_template: bool = True, **config: object) -> Path:
    tok = AutoTokenizer.from_pretrained(tokenizer_path())
    if not chat_template:
        tok.chat_template = None
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=1024,
            **config,
        )
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _plan(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()[-1] if out.err.strip() else ""


def test_a_checkpoint_is_accepted_and_described(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _checkpoint(tmp_path / "m", vocab=576)  # rows padded past the tokenizer's 514: fine
    code, out, _ = _plan(["--model", str(model)], capsys)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0] == f"model: {model} (LlamaForCausalLM, model type 'llama', 1 layer)"
    assert "vocabulary: model 576 ids, tokenizer 514 ids" in lines
    assert lines[-1].startswith("accepted: ")


def test_with_lora_only_the_adapters_are_trained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _checkpoint(tmp_path / "m", vocab=514)
    code, out, _ = _plan(["--model", str(model), "--set", "model.lora.r=2"], capsys)
    assert code == 0
    found = re.search(r"^parameters: ([\d,]+), trained: ([\d,]+) \(LoRA adapters\)$", out, re.M)
    assert found is not None, out
    total, adapters = (int(g.replace(",", "")) for g in found.groups())
    assert 0 < adapters < total


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _checkpoint(tmp_path / "m", vocab=500)
    code, _, err = _plan(["--model", str(model)], capsys)
    assert code == 2
    assert err.startswith(
        "treetrain plan: model.tokenizer: the tokenizer has 514 ids but the model's vocabulary is 500"
    )
    with pytest.raises(ConfigError, match="the tokenizer has 514 ids"):  # training refuses it as well
        load_models(ModelSection(path=str(model)))


def test_a_tokenizer_without_a_template_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _checkpoint(tmp_path / "m", vocab=514, chat_template=False)
    code, _, err = _plan(["--model", str(model)], capsys)
    assert code == 2 and err.endswith("has no chat_template; give a tokenizer that has one (model.tokenizer)")


def test_an_unsupported_model_is_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = _checkpoint(tmp_path / "m", vocab=514, rope_parameters=rope)
    code, _, err = _plan(["--model", str(model)], capsys)
    assert code == 2 and err.startswith("treetrain plan: model type 'llama' uses rope_type 'dynamic'")


def test_plan_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _plan([], capsys)
    assert code == 2 and err == (
        "treetrain plan: give tree files to plan, or --model ('demo', a model directory, tiny-<family>) to check"
    )
    code, _, err = _plan(["trees/tool_use.msgpack", "--model", "tiny-qwen3"], capsys)
    assert code == 2 and err == "treetrain plan: give --budget (8GiB, 512MiB, ...) to plan TREES within it"
