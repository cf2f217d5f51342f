"""From the run's settings to the planner's decision for one update.

The planner (`treetrain.memory.planner`) sees the update's batch, the model and a memory budget, and chooses
tree or flat mode, K, chunk size, retention and kept graphs; whatever the `replay` section fixes is passed as
an override. Without `memory_budget`, the budget is the device's memory (total RAM on a CPU). The `Plan` it
returns is the one plan object of the update, from here to the replayer: the update's window lays it out
over its rank's trees (`Plan.lay_out`), and the replayer is built from it (`treetrain.update.learner`). A plan over its budget (a forced `mode` whose smallest peak does
not fit) is refused here in one line (`Plan.over_budget`), before anything is replayed.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PreTrainedModel

from treetrain.memory.budget import memory_budget_bytes
from treetrain.memory.persistent import model_persistent_bytes
from treetrain.memory.planner import Plan, PlanError, plan_update
from treetrain.models.lora import Reference
from treetrain.replay import UpdateBatch
from treetrain.update.settings import UpdateSettings


def plan_for(
    cfg: UpdateSettings,
    batch: UpdateBatch,
    model: PreTrainedModel,
    ref_model: Reference | None,
    *,
    world_size: int = 1,
    zero_stage: int = 0,
    offload_optimizer: bool = False,
    context_parallel: int = 1,
) -> Plan:
    """Plan one update of `batch` (the whole update, every rank's share). `world_size`, `zero_stage` and
    `offload_optimizer` are what the backend really runs with: they size the run-persistent bytes.
    `context_parallel` > 1 prices one rank of a context group of that many (`ReplayConfig.context_parallel`)."""
    budget = memory_budget_bytes(cfg.memory_budget, next(model.parameters()).device)
    persistent = model_persistent_bytes(
        model,
        ref_model=ref_model,
        optimizer=True,
        zero_stage=zero_stage,
        world_size=world_size,
        offload_optimizer=offload_optimizer,
    )
    plan = plan_update(
        batch,
        model,
        budget=budget,
        loss=cfg.policy_loss,
        overrides=cfg.replay.overrides(cfg.mode),
        ref_model=ref_model,
        persistent=persistent,
        base=replace(cfg.replay.replay_config(cfg.seed), context_parallel=context_parallel),
        min_speedup=cfg.replay.min_speedup,
    )
    if plan.over_budget is not None:  # a forced mode the budget cannot hold: refused, never run into an OOM
        raise PlanError(plan.over_budget)
    return plan
