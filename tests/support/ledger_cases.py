"""Shared pieces of the ledger-accuracy tests: a one-tree update, and its peak measured by the tracker."""

from __future__ import annotations

import torch

from treetrain.lifetime import ClassBytes
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.tracker import MemoryTracker
from treetrain.replay import ReplayConfig, TreeReplay, UpdateBatch
from treetrain.replay.flat_reference import FlatReference
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.tree.synthetic import synthetic_group


def ledger_batch(
    prefix: int, branches: int, suffix: int, *, depth: int, vocab: int, loss: LossConfig
) -> UpdateBatch:
    """One synthetic tree (prefix, `branches` of `suffix` tokens, `depth` levels), every third leaf rewarded."""
    rewards = [float(i % 3 == 0) for i in range(branches)]
    tree = synthetic_group(
        prefix=prefix, branches=branches, suffix=suffix, depth=depth, vocab=vocab, seed=1, rewards=rewards
    )
    adv = compute_advantages([tree], AdvantageConfig())
    return UpdateBatch.build([tree], adv.trees, loss)


def zero_grads(model: torch.nn.Module) -> None:
    """Gradients allocated up front: the ledger books them for the whole update window."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def measured_tree(
    model: torch.nn.Module, batch: UpdateBatch, replay: ReplayConfig, loss: LossConfig
) -> ClassBytes:
    """The tracker's peak by class of one tree update."""
    zero_grads(model)
    tracker = MemoryTracker()
    report = TreeReplay(model, loss, replay, hooks=ReplayHooks(tracker=tracker)).accumulate(batch)
    tracker.detach()
    assert report.measured_peak is not None
    return report.measured_peak


def measured_flat(model: torch.nn.Module, batch: UpdateBatch, loss: LossConfig) -> int:
    """The tracker's dynamic peak (everything but parameters) of the flat reference's update."""
    zero_grads(model)
    tracker = MemoryTracker()
    tracker.attach_model(model)
    with tracker:
        FlatReference(model, loss).accumulate(batch)
    tracker.detach()
    return tracker.peak.dynamic


def error(predicted: int, measured: int) -> float:
    """Relative error of a prediction, signed (positive: the ledger books more than was measured)."""
    return (predicted - measured) / measured
