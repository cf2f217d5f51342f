"""A mixture-of-experts checkpoint directory trains in float64 (`treetrain.models.presets.load_model`).

transformers' default experts kernel (grouped matmul) takes float32, bfloat16 and float16 only, so a user's
MoE checkpoint loaded in float64 (the dtype in which updates are compared at their floor) failed at its
first forward. `load_model` picks the per-expert loop there. The control: the same directory loaded the
default way fails in float64, so the test would see the kernel come back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from treetrain.models.presets import PER_EXPERT_LOOP, load_model, tiny_model


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_mixture_of_experts_checkpoint_runs_forward_and_backward_in_float64(
    tmp_path: Path, family: str
) -> None:
    saved = tiny_model(family, vocab_size=64, seed=0)
    saved.config._experts_implementation = None  # a checkpoint on disk names no implementation
    saved.save_pretrained(tmp_path)
    ids = torch.tensor([[3, 5, 7, 11, 13]])

    model = load_model(tmp_path, dtype=torch.float64)
    assert model.config._experts_implementation == PER_EXPERT_LOOP
    logits = model(ids).logits  # [1, T, V]
    assert logits.dtype == torch.float64
    logits.logsumexp(-1).sum().backward()
    experts = [p.grad for n, p in model.named_parameters() if "experts" in n]
    assert experts and all(g is not None and g.dtype == torch.float64 for g in experts)
    assert any(float(g.abs().sum()) > 0 for g in experts if g is not None)

    kept = load_model(tmp_path, dtype=torch.float32)  # float32 keeps transformers' choice
    default = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, local_files_only=True)
    assert kept.config._experts_implementation == default.config._experts_implementation
    if default.config._experts_implementation == "grouped_mm":  # where transformers picks the kernel
        as_is = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, local_files_only=True)
        with pytest.raises(RuntimeError, match="Double"):  # the control: what load_model avoids
            as_is(ids)
