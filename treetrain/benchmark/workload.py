"""The benchmarked update: the model, one grid point's synthetic group, and one update in any mode.

Every mode accumulates parameter gradients for the same `UpdateBatch` (same manifest, same loss), so they
differ only in how the work is arranged. Gradients are allocated before the first update and zeroed in
place between updates, as a trainer (or a ZeRO engine's preallocated buffers) does; the optimizer step
is the same for every mode and is left out of the timing.

Example:
    >>> model = bench_model(QUICK.model)                                              # doctest: +SKIP
    >>> batch = bench_batch(GridPoint(48, 2, 8, 1), QUICK)                            # doctest: +SKIP
    >>> seconds, report = time_one_update(model, batch, "exact", QUICK)                   # doctest: +SKIP
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from treetrain.benchmark.bench_config import BenchConfig, GridPoint, Mode, ModelSpec
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.models.presets import TinySize, tiny_model
from treetrain.models.support import SupportGate
from treetrain.replay.batch import ReplayConfig, ReplayReport, UpdateBatch
from treetrain.replay.flat_reference import FlatReference
from treetrain.replay.protocols import MemoryProbe
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.tree_replay import TreeReplay
from treetrain.tree.synthetic import synthetic_group
from treetrain.tree.trajectory_tree import TrajectoryTree

LOSS = LossConfig(ratio_source="sampler")
"""PPO-clip with the sampler's logprobs: no scoring pass in any mode."""


def bench_model(spec: ModelSpec) -> PreTrainedModel:
    """The random-init model of `spec`, with zeroed gradients allocated."""
    size = TinySize(
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_positions=spec.max_positions,
    )
    dtype = getattr(torch, spec.dtype)
    model = tiny_model(spec.family, spec.vocab_size, size=size, attn=spec.attn, dtype=dtype, seed=spec.seed)
    zero_grads(model)
    return model


def zero_grads(model: torch.nn.Module) -> None:
    """Zero every parameter's gradient in place, allocating it the first time."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def bench_tree(point: GridPoint, cfg: BenchConfig) -> TrajectoryTree:
    """The synthetic group of `point`; rewards alternate 1, 0 so every branch carries loss."""
    rewards = [float(i % 2 == 0) for i in range(point.branches)]
    return synthetic_group(
        prefix=point.prefix,
        branches=point.branches,
        suffix=point.suffix,
        depth=point.depth,
        vocab=cfg.model.vocab_size,
        seed=cfg.seed,
        rewards=rewards,
    )


def bench_batch(point: GridPoint, cfg: BenchConfig, tree: TrajectoryTree | None = None) -> UpdateBatch:
    tree = tree or bench_tree(point, cfg)
    adv = compute_advantages([tree], AdvantageConfig(zero_variance="keep"))
    return UpdateBatch.build([tree], adv.trees, LOSS)


def replay_config(mode: Mode, cfg: BenchConfig) -> ReplayConfig:
    """The tree engine's settings for `mode` (not for flat)."""
    if mode == "flat":
        raise ValueError("flat does not use a ReplayConfig")
    return ReplayConfig(contract=mode, microbatch=cfg.microbatch, chunk_size=cfg.chunk_size)


def make_engine(
    model: PreTrainedModel, mode: Mode, cfg: BenchConfig, tracker: MemoryProbe | None = None
) -> FlatReference | TreeReplay:
    if mode == "flat":
        return FlatReference(model, LOSS, ReplayConfig(microbatch=cfg.flat_microbatch))
    return TreeReplay(
        model,
        LOSS,
        replay_config(mode, cfg),
        support=SupportGate(trusting=True),
        hooks=ReplayHooks(tracker=tracker),
    )


def time_one_update(
    model: PreTrainedModel, batch: UpdateBatch, mode: Mode, cfg: BenchConfig
) -> tuple[float, ReplayReport]:
    """One update in `mode`: wall seconds of the gradient accumulation, and its report."""
    engine = make_engine(model, mode, cfg)
    zero_grads(model)
    start = time.perf_counter()
    report = engine.accumulate(batch)
    return time.perf_counter() - start, report
