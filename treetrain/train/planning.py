"""From the trainer's config to the planner's decision for one update, and the engine options it implies.

The planner (`treetrain.memory.planner`) sees the update's trees, the model and a memory budget, and chooses
tree or flat mode, K, chunk size, retention and kept graphs; whatever the config fixes is passed as an
override. Without `memory_budget`, the budget is the device's memory (total RAM on a CPU).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treetrain.bytesize import parse_bytes
from treetrain.engine import ReplayConfig, UpdateBatch
from treetrain.engine.protocols import KeepGraph
from treetrain.loss.advantages import TreeAdvantages
from treetrain.loss.manifest import Manifest
from treetrain.memory.persistent import model_persistent_bytes
from treetrain.memory.planner import Overrides, Plan, plan_update
from treetrain.memory.retention import RetentionPolicy
from treetrain.models.lora import Reference
from treetrain.train.config import TrainConfig
from treetrain.tree import TrajectoryTree


def device_memory(device: torch.device) -> int:
    """Bytes of memory on `device` (CUDA: the card's total; CPU: physical RAM)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def base_replay(cfg: TrainConfig) -> ReplayConfig:
    r = cfg.replay
    return ReplayConfig(
        contract=r.contract,
        score_microbatch=r.score_microbatch,
        skip_inert=r.skip_inert,
        max_logit_elements=r.max_logit_elements,
        seed=cfg.seed,
    )


def overrides(cfg: TrainConfig) -> Overrides:
    r = cfg.replay
    retention: int | str | None = r.retention
    if retention is not None and retention != "unbounded":
        retention = parse_bytes(retention)
    return Overrides(
        mode=None if cfg.mode == "auto" else cfg.mode,
        microbatch=r.microbatch,
        chunk_size=r.chunk_size,
        retention=retention,  # type: ignore[arg-type]
        keep_graphs=r.keep_graphs,
    )


@dataclass(frozen=True)
class UpdatePlan:
    """The planner's decision and what the engine needs to carry it out."""

    plan: Plan
    replay: ReplayConfig
    retention: RetentionPolicy | None
    keep_graph: KeepGraph | None

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def predicted_dynamic_bytes(self) -> int:
        """The ledger's peak without run-persistent bytes (what the schedule controls)."""
        return int(self.plan.ledger.peak.dynamic)


def plan_for(
    cfg: TrainConfig,
    trees: Sequence[TrajectoryTree],
    advantages: Sequence[TreeAdvantages],
    version: int,
    model: PreTrainedModel,
    ref_model: Reference | None,
    world_size: int,
    *,
    zero_stage: int = 0,
    offload_optimizer: bool = False,
) -> UpdatePlan:
    """Plan one update; `zero_stage` and `offload_optimizer` are what the backend really runs with."""
    budget = (
        parse_bytes(cfg.memory_budget)
        if cfg.memory_budget
        else device_memory(next(model.parameters()).device)
    )
    batch = UpdateBatch.build(list(trees), list(advantages), Manifest.build(trees, version), cfg.loss)
    persistent = model_persistent_bytes(
        model,
        ref_model=ref_model,
        optimizer=True,
        zero_stage=zero_stage,
        world_size=world_size,
        offload_optimizer=offload_optimizer,
    )
    base = base_replay(cfg)
    plan = plan_update(
        batch,
        model,
        budget=budget,
        contract=cfg.replay.contract,
        loss=cfg.loss,
        overrides=overrides(cfg),
        ref_model=ref_model,
        persistent=persistent,
        base=base,
        min_speedup=cfg.replay.min_speedup,
    )
    if plan.mode == "flat":
        return UpdatePlan(plan, plan.replay_config(base), None, None)
    retention = RetentionPolicy(plan.retention) if plan.retention is not None else None
    keep = plan.keep_graph_fn() if plan.keep_graph else None
    return UpdatePlan(plan, plan.replay_config(base), retention, keep)
