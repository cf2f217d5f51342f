"""One distributed update for tests/distributed/worker.py's scenarios: a DeepSpeed backend per ZeRO stage,
one update window run over it, and what happened (the parameter delta and an `Info` record).

Imported only inside the `torchrun` ranks the worker runs in: every function here takes part in
collectives, so each rank calls it alike.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import deepspeed
import torch

from support.dist_cases import LOSS, OPTIMIZER, STAGES, groups, model_factory, params_vector, uneven_owned
from treetrain.distributed import OptimizerConfig, build_placement, round_robin
from treetrain.distributed.deepspeed_backend import DeepSpeedBackend
from treetrain.replay import ReplayConfig
from treetrain.replay.replay_plan import ReplayHooks
from treetrain.replay.resident import ResidentIdentity, ResidentStore
from treetrain.update.window import UpdateWindow
from treetrain.update.window_types import WindowConfig

Info = dict[str, Any]
"""What a scenario reports besides the parameter delta (rank 0 writes it as JSON)."""


USER_CONFIG_STAGES = {"z1"}
"""Stages whose backend is built from a user DeepSpeed config (a mapping) instead of arguments."""


def backend_for(
    stage_name: str, optimizer: OptimizerConfig = OPTIMIZER, *, measure: bool = False, family: str = "llama"
) -> DeepSpeedBackend:
    stage, offload = STAGES[stage_name]
    model = model_factory(family)()
    if stage_name in USER_CONFIG_STAGES:
        offload_block = {"device": "cpu" if offload else "none"}
        user = {"zero_optimization": {"stage": stage, "offload_optimizer": offload_block}}
        return DeepSpeedBackend(model, ds_config=user, optimizer=optimizer, measure_params=measure)
    return DeepSpeedBackend(
        model, zero_stage=stage, offload_optimizer=offload, optimizer=optimizer, measure_params=measure
    )


def current(backend: DeepSpeedBackend) -> torch.Tensor:
    params = list(backend.module.parameters())
    gathered = deepspeed.zero.GatheredParameters(params) if backend.zero_stage == 3 else nullcontext()
    with gathered:
        return params_vector(backend.module)


def param_storage(backend: DeepSpeedBackend) -> int:
    """Bytes of parameter storage on this rank now: full tensors and, under ZeRO-3, partitions."""
    total = 0
    for p in backend.module.parameters():
        total += p.data.numel() * p.element_size()
        part = getattr(p, "ds_tensor", None)
        if part is not None:
            total += part.numel() * part.element_size()
    return total


def one_update(
    stage_name: str,
    replay: ReplayConfig | None = None,
    *,
    placement: str = "planner",
    step_hook: Callable[..., None] | None = None,
    body: Callable[[Any], None] | None = None,
    optimizer: OptimizerConfig = OPTIMIZER,
    update: list[Any] | None = None,
    measure: bool = False,
    family: str = "llama",
    **window_kw: Any,
) -> tuple[torch.Tensor, Info]:
    backend = backend_for(stage_name, optimizer, measure=measure, family=family)
    start = current(backend)
    update = groups() if update is None else update
    trees = [t for g in update for t in g.trees]
    sampled = [0]

    def sample(phase: str, step: Any) -> None:  # parameter storage at every replay phase
        sampled[0] = max(sampled[0], param_storage(backend))
        if step_hook is not None:
            step_hook(phase, step)

    window = UpdateWindow(backend, LOSS, replay, WindowConfig(**window_kw), hooks=ReplayHooks(step=sample))
    if placement == "round_robin":
        given = round_robin(trees, backend.world_size)
    elif placement in ("uneven", "idle"):
        given = build_placement(
            trees, uneven_owned(update, backend.world_size, placement), backend.world_size
        )
    else:
        given = None
    backend.reset_param_peak()
    opened = window.open(update, given)
    if body is not None:
        body(opened)
    opened.replay_all()
    report = opened.commit()
    sync = backend.rendezvous
    info = {
        "version": report.version,
        "tree_retries": report.tree_retries,
        "window_resets": report.window_resets,
        "oom_splits": report.local.oom_splits,
        "dropped": [[d.index, d.reason] for d in report.dropped],
        "duplicated_tokens": opened.placement.duplicated_tokens,
        "zero_stage": backend.zero_stage,
        "offload_optimizer": backend.offload_optimizer,
        "steps": report.local.steps,
        "rank_tokens": list(report.rank_tokens),
        "imbalance": report.imbalance,
        "rounds": sync.rounds if sync is not None else 0,
        "served": sync.served if sync is not None else 0,
        "param_peak_bytes": backend.param_peak_bytes,
        "param_sampled_bytes": sampled[0],
        "partition_bytes": sum(
            p.ds_tensor.numel() * p.ds_tensor.element_size()
            for p in backend.module.parameters()
            if getattr(p, "ds_tensor", None) is not None
        ),
    }
    return current(backend) - start, info


def store_at(backend: Any, version: int) -> ResidentStore:
    """A resident store for the backend's model at `version` (a resumed or a deliberately mismatched run)."""
    return ResidentStore(ResidentIdentity.of(backend.module, version=version))
