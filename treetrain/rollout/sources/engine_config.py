"""The one place a run's settings become the rollout's: the engine to build, the token wrapper's budgets
and the rollout's schedule.

The trainer names no inference engine: it hands its settings (`RunSettings`) to a tree source, which calls
`engine_spec` for the engine factory (`treetrain.rollout.engines.factory`), `wrapper_config` for the
token wrapper (`envs.wrapper`) and `rollout_config` for `rollout_trees`. `treetrain eval` builds its engine
through the same functions, so a setting means the same in both.
"""

from __future__ import annotations

import logging
from typing import Any

from envs.wrapper import WrapperConfig
from treetrain.rollout.engines.factory import EngineSpec
from treetrain.rollout.prefix_sampler import SamplerConfig
from treetrain.rollout.sources.run_settings import RunSettings
from treetrain.rollout.tree_rollout import RolloutConfig

HF_KV_SHARE = 4
"""Without `rollout.hf_kv_budget`, the `hf` engine's KV cache may take 1/HF_KV_SHARE of the memory budget:
the rollout runs between updates, so this is memory the update's plan does not hold at the same time. An
asynchronous sampler on another device than the trainer's (ZeRO-3's, on the CPU) runs beside training, and
takes 1/HF_KV_SHARE of what that device has free when the run starts."""


def engine_spec(
    cfg: RunSettings, model: Any, world_size: int, checkpoint: str, sampler_device: str | None = None
) -> EngineSpec:
    """What the engine factory needs to know about this run; `checkpoint` is where `model.path` resolved to
    (a directory, or a preset's name). `sampler_device` is where an `hf` sampler holds its KV cache when that
    is not the model's device (ZeRO-3's shadow samples on the CPU): `memory_budget` is the trainer's device's,
    so there the default KV budget is a share of what that device has free instead."""
    import torch

    from treetrain.bytesize import parse_bytes
    from treetrain.memory.budget import free_memory, memory_budget_bytes

    r = cfg.rollout
    trainer = next(model.parameters()).device
    sampler = trainer if sampler_device is None else torch.device(sampler_device)
    if r.hf_kv_budget is not None:
        kv_bytes = parse_bytes(r.hf_kv_budget)
    elif sampler != trainer:
        kv_bytes = free_memory(sampler) // HF_KV_SHARE
    else:
        kv_bytes = memory_budget_bytes(cfg.memory_budget, trainer) // HF_KV_SHARE
    lora_z3 = (
        cfg.model.lora is not None
        and cfg.distributed.backend == "deepspeed"
        and cfg.distributed.zero_stage == 3
    )
    return EngineSpec(
        r.engine, r.vllm, run_dir=cfg.run_dir, model_path=str(cfg.model.path), checkpoint=checkpoint,
        max_tokens=wrapper_config(cfg, model).episode.episode_tokens(), dtype=cfg.model.dtype, seed=cfg.seed,
        world_size=world_size, lora_under_zero3=lora_z3, hf_kv_bytes=kv_bytes,
        in_flight_weights=r.max_staleness >= 1, threads=cfg.threads,
    )  # fmt: skip


def wrapper_config(cfg: RunSettings, model: Any) -> WrapperConfig:
    """The episode budgets, template settings and stop ids of the rollouts (the model fills the gaps)."""
    r, e = cfg.rollout, cfg.env
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops = tuple(int(t) for t in ([eos] if isinstance(eos, int) else eos or ()))
    return WrapperConfig(
        episode=r.episode.for_context(model_context(model)), max_tool_result_chars=e.max_tool_result_chars,
        end_of_turn=e.end_of_turn, tool_format=e.tool_format, stop_token_ids=stops,
        template_kwargs=dict(e.template_kwargs),
    )  # fmt: skip


def rollout_config(cfg: RunSettings, wrapper: WrapperConfig, version: int | None) -> RolloutConfig:
    """How the run grows one update's trees; `version` is the weight version every sample must come from
    (None: not checked, the sampler of an asynchronous run records each turn's own)."""
    r = cfg.rollout
    return RolloutConfig(
        fanout=r.fanout, sampler=SamplerConfig(r.sampling, seed=cfg.seed), wrapper=wrapper,
        rubric=cfg.env.rubric, model_version=version, max_concurrent_steps=r.max_concurrent_steps,
    )  # fmt: skip


def model_context(model: Any) -> int | None:
    """The longest sequence the model takes (`max_position_embeddings`), or None when it does not say."""
    return config_context(model.config.get_text_config(decoder=True))


def config_context(config: Any) -> int | None:
    """`model_context` read from a text config, before the model is built."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def engine_loggers() -> list[logging.Logger]:
    """The inference libraries' loggers that have console handlers of their own (vLLM's, once imported),
    which a progress bar must redirect beside the root logger's."""
    vllm = logging.getLogger("vllm")
    return [vllm] if vllm.handlers else []
