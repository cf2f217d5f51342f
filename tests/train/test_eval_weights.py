"""Loading a run checkpoint's weights for `treetrain eval`: what the header check cannot judge (a preset
without files to compare with, names in another layout) is one line when the weights are loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file, save_model

from treetrain.errors import ConfigError
from treetrain.models.presets import load_model
from treetrain.train.eval_weights import load_checkpoint_weights


def test_weights_that_fit_load_and_others_are_one_line(tmp_path: Path) -> None:
    policy = load_model("tiny-llama", vocab_size=64)
    save_model(policy, str(tmp_path / "own.safetensors"))
    save_model(load_model("tiny-llama", vocab_size=128), str(tmp_path / "wider.safetensors"))
    save_file({"other.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    raw = (tmp_path / "own.safetensors").read_bytes()
    (tmp_path / "torn.safetensors").write_bytes(raw[: len(raw) // 2])

    load_checkpoint_weights(policy, tmp_path / "own.safetensors")  # the negative control
    for name, wanted in (
        ("wider", "size mismatch for model.embed_tokens.weight"),
        ("other", "Missing key"),
        ("torn", "not a complete safetensors file"),
    ):
        with pytest.raises(ConfigError, match=wanted) as caught:
            load_checkpoint_weights(policy, tmp_path / f"{name}.safetensors")
        assert "\n" not in str(caught.value) and f"{name}.safetensors" in str(caught.value)
