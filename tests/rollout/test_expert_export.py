"""A mixture of experts goes to the inference engine per expert, under the checkpoint's names, from
transformers' fused in-memory stacks: a fresh model loaded from the export computes the same logits, bit for
bit; two experts swapped in the export (the negative control) do not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.moe_cases import tiny_moe
from transformers import AutoModelForCausalLM

from treetrain.rollout.engines.weight_buckets import fused_experts, weight_buckets

IDS = torch.tensor([[1, 5, 9, 40, 7, 300, 12, 2]])


def _trained(family: str) -> torch.nn.Module:
    """The tiny MoE after a step that moves every expert, so the export carries weights no init produced."""
    model = tiny_moe(family)
    for p in model.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    return model


def _export(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The engine's copy, one small bucket at a time, written as a checkpoint beside the model's config."""
    exported = {name: t.clone() for bucket in weight_buckets(model, bucket_bytes=4096) for name, t in bucket}
    model.config.save_pretrained(directory)  # type: ignore[operator]
    return exported


def _logits(exported: dict[str, torch.Tensor], directory: Path) -> torch.Tensor:
    save_file(exported, str(directory / "model.safetensors"), metadata={"format": "pt"})
    fresh = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return fresh(IDS).logits


@pytest.mark.parametrize(
    ("family", "expert"),
    [("qwen3_moe", "model.layers.{layer}.mlp.experts.{i}.gate_proj.weight"),
     ("mixtral", "model.layers.{layer}.block_sparse_moe.experts.{i}.w1.weight")],
)  # fmt: skip
def test_the_per_expert_export_loads_back_into_the_same_function(
    family: str, expert: str, tmp_path: Path
) -> None:
    model = _trained(family)
    with torch.no_grad():
        expected = model(IDS).logits
    exported = _export(model, tmp_path)
    assert all(t.dim() <= 2 for t in exported.values())  # no fused stack reaches the engine
    assert {expert.format(layer=1, i=i) for i in range(4)} <= exported.keys()
    assert fused_experts(model) is None  # so rollout.engine=vllm accepts it
    assert torch.equal(_logits(exported, tmp_path), expected)


def test_two_experts_swapped_in_the_export_change_the_logits(tmp_path: Path) -> None:
    model = _trained("qwen3_moe")
    with torch.no_grad():
        expected = model(IDS).logits
    exported = _export(model, tmp_path)
    for part in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.0.mlp.experts.{i}.{part}.weight" for i in (0, 1))
        exported[a], exported[b] = exported[b], exported[a]
    gap = (_logits(exported, tmp_path) - expected).abs().max().item()
    assert gap > 1e-2, gap


def test_a_stack_with_no_checkpoint_layout_is_still_named() -> None:
    class Stacked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.Parameter(torch.zeros(2, 3, 4))

    assert fused_experts(Stacked()) == "experts"
