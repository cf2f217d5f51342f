"""Differential checks: compare a tree-mode gradient with the flat reference, against a measured noise floor.

The noise floor is how far two equally valid flat runs disagree. Two sources are measured and the larger
is used: (a) the flat run with another summation order (trajectories reversed, different microbatching),
and (b) the flat run with every parameter moved by one float32 rounding step. (b) matters because Hugging
Face models keep float32 islands (RMSNorm, RoPE, softmax) even in float64, so two float64 runs that split
the work differently agree only to about 1e-8, whatever their summation order.

Example (a tiny float64 model: `exact` tree replay lands within the flat runs' own disagreement):
    >>> import torch
    >>> from treetrain import build_batch
    >>> from treetrain.models.presets import tiny_model
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> make_model = lambda: tiny_model("llama", 64, dtype=torch.float64)
    >>> batch = build_batch([synthetic_group(prefix=16, branches=3, suffix=4, depth=1, vocab=64, seed=0)]).batch
    >>> floor = noise_floor(make_model, batch, LossConfig())
    >>> flat = flat_gradient(make_model(), batch, LossConfig())
    >>> tree = tree_gradient(make_model(), batch, LossConfig(), ReplayConfig(contract="exact"))
    >>> deviation(tree, flat).abs <= 5 * floor
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treetrain.loss.loss_config import LossConfig
from treetrain.models.lora import AdaptersOff, Reference
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.flat_reference import ONE_CALL, FlatReference
from treetrain.replay.tree_replay import TreeReplay

ModelFactory = Callable[[], PreTrainedModel]


@dataclass(frozen=True)
class Deviation:
    """How far gradient `a` is from reference `b`."""

    abs: float
    """L2 norm of a - b."""
    rel: float
    """abs / |b|."""
    cosine: float


def flat_grad(model: PreTrainedModel) -> torch.Tensor:
    """All parameter gradients as one float64 vector (zeros where a parameter got none)."""
    parts = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append(g.detach().reshape(-1).to(torch.float64).cpu())
    return torch.cat(parts)


def deviation(a: torch.Tensor, b: torch.Tensor) -> Deviation:
    diff = float((a - b).norm())
    ref = float(b.norm())
    cos = (
        float(torch.nn.functional.cosine_similarity(a, b, dim=0)) if ref > 0 and float(a.norm()) > 0 else 1.0
    )
    return Deviation(diff, diff / ref if ref > 0 else diff, cos)


def flat_gradient(
    model: PreTrainedModel,
    batch: UpdateBatch,
    loss: LossConfig,
    ref_model: Reference | None = None,
    replay: ReplayConfig = ONE_CALL,
) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    FlatReference(model, loss, replay, ref_model=ref_model).accumulate(batch)
    return flat_grad(model)


def tree_gradient(
    model: PreTrainedModel,
    batch: UpdateBatch,
    loss: LossConfig,
    replay: ReplayConfig,
    ref_model: Reference | None = None,
) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    TreeReplay(model, loss, replay, ref_model=ref_model).accumulate(batch)
    return flat_grad(model)


@torch.no_grad()
def _perturb(model: PreTrainedModel, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        p.mul_(1 + 2.0**-24 * noise)


def noise_floor(
    make_model: ModelFactory,
    batch: UpdateBatch,
    loss: LossConfig,
    make_ref: ModelFactory | None = None,
    *,
    adapters_off_reference: bool = False,
) -> float:
    """Largest disagreement between equally valid flat runs (see module docstring), as an L2 norm.

    `adapters_off_reference`: the reference is each run's own model with its LoRA adapters off.
    """
    shared = make_ref() if make_ref else None

    def ref(model: PreTrainedModel) -> Reference | None:
        return AdaptersOff(model) if adapters_off_reference else shared

    base_model = make_model()
    base = flat_gradient(base_model, batch, loss, ref(base_model))
    other = make_model()
    reordered = flat_gradient(other, batch, loss, ref(other), ReplayConfig(order="reverse", microbatch=2))
    moved_model = make_model()
    _perturb(moved_model, seed=1234)
    moved = flat_gradient(moved_model, batch, loss, ref(moved_model))
    return max(float((base - reordered).norm()), float((base - moved).norm()))
