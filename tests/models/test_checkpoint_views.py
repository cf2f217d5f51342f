"""A checkpoint whose loading splits a fused tensor into views trains and saves (`presets.load_model`).

transformers' conversion for Lara splits the checkpoint's fused `in_proj_qkvz` into four parameters that are
views of one tensor. `treetrain train` then failed at its first checkpoint with a traceback: safetensors
refuses a view that does not cover its storage. The control: the same directory loaded the default way
holds such views, and saving it is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_model
from transformers import AutoModelForCausalLM

from treetrain.models.presets import load_model, tiny_model


def _views(model: torch.nn.Module) -> list[str]:
    return [
        n for n, p in model.named_parameters() if p.untyped_storage().nbytes() != p.numel() * p.element_size()
    ]


def test_a_split_fused_weight_is_saved_as_the_values_it_holds(tmp_path: Path) -> None:
    tiny_model("lara_mini", vocab_size=64, seed=0).save_pretrained(tmp_path / "ckpt")
    default = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    assert _views(default), "transformers no longer splits the fused weight into views"
    with pytest.raises(RuntimeError, match="storage"):
        save_model(default, str(tmp_path / "refused.safetensors"))

    model = load_model(tmp_path / "ckpt")
    assert _views(model) == []
    save_model(model, str(tmp_path / "model.safetensors"))  # what a run's checkpoint writes
    saved = load_file(tmp_path / "model.safetensors")
    for name, p in default.named_parameters():
        assert torch.equal(saved[name], p.detach()), name
