"""The DeepSpeed config a `DeepSpeedBackend` runs with: built from treetrain's settings, or read from the
user's JSON file and then given treetrain's optimizer, clipping and accumulation boundary.

Why its own module: what a config may say, and what treetrain overrides, is policy that is checked before
DeepSpeed starts (and tested without it); the backend only hands the result to `deepspeed.initialize`.

Example:
    >>> cfg = default_config(zero_stage=2, optimizer=OptimizerConfig(lr=1e-5), dtype=torch.bfloat16,
    ...                      offload_optimizer=False, torch_adam=True)
    >>> config_zero_stage(cfg), config_offload(cfg)
    (2, False)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from treetrain.distributed.optim_config import OptimizerConfig
from treetrain.errors import ConfigError
from treetrain.jsonfile import read_json_object

MAX_CONFIG_BYTES = 1 << 20
"""A DeepSpeed config file larger than this is refused before it is parsed."""
_DTYPES = {torch.float32: None, torch.bfloat16: "bf16", torch.float64: None}
FLOAT64_STAGES = (
    "DeepSpeed reduces gradients in float32 at ZeRO 1-2 and has no float64 parameters at ZeRO-3; "
    "float64 runs at ZeRO 0 (distributed.zero_stage=0), where treetrain reduces the gradients itself"
)
"""Why a float64 model is refused at ZeRO 1-3 (a silent float32 reduction, or DeepSpeed's assertion)."""


def optimizer_section(optimizer: OptimizerConfig, *, torch_adam: bool) -> dict[str, Any]:
    """The DeepSpeed `optimizer` section for `optimizer`. SGD is a type DeepSpeed does not implement
    itself, so it builds `torch.optim.SGD` from it (under every ZeRO stage, with or without offload)."""
    if optimizer.name == "sgd":
        return {"type": "SGD", "params": {"lr": optimizer.lr, "weight_decay": optimizer.weight_decay}}
    params: dict[str, Any] = {
        "lr": optimizer.lr,
        "betas": list(optimizer.betas),
        "eps": optimizer.eps,
        "weight_decay": optimizer.weight_decay,
    }
    if torch_adam:
        params["torch_adam"] = True
    return {"type": "AdamW", "params": params}


def optimizer_flags(optimizer: OptimizerConfig, *, torch_adam: bool, offload: bool) -> dict[str, Any]:
    """The top-level keys DeepSpeed needs to accept the optimizer `optimizer_section` builds: ZeRO calls
    torch's AdamW and SGD 'untested', and offload wants its CPU Adam unless told otherwise."""
    flags: dict[str, Any] = {"zero_allow_untested_optimizer": True}
    if torch_adam and offload and optimizer.name == "adamw":
        flags["zero_force_ds_cpu_optimizer"] = False
    return flags


def config_zero_stage(cfg: Mapping[str, Any]) -> int:
    """The ZeRO stage a DeepSpeed config asks for (DeepSpeed's default: 0)."""
    zero = cfg.get("zero_optimization", {})
    return int(zero.get("stage", 0)) if isinstance(zero, Mapping) else 0


def config_offload(cfg: Mapping[str, Any]) -> bool:
    """Whether a DeepSpeed config offloads the optimizer (device 'cpu' or 'nvme'; absent or 'none': no)."""
    zero = cfg.get("zero_optimization", {})
    block = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    device = block.get("device", "none") if isinstance(block, Mapping) else "none"
    return str(device).lower() in ("cpu", "nvme")


def default_config(
    *,
    zero_stage: int,
    offload_optimizer: bool,
    optimizer: OptimizerConfig,
    dtype: torch.dtype,
    torch_adam: bool,
) -> dict[str, Any]:
    """The DeepSpeed config generated from explicit arguments when the user gives none."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if offload_optimizer and zero_stage == 0:
        raise ConfigError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {[str(d) for d in _DTYPES]}, got {dtype}")
    if dtype == torch.float64 and zero_stage != 0:
        raise ConfigError(f"model.dtype float64 at ZeRO-{zero_stage}: {FLOAT64_STAGES}")
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optimizer.grad_clip,
        "steps_per_print": 2**31 - 1,
        "optimizer": optimizer_section(optimizer, torch_adam=torch_adam),
        "zero_optimization": zero,
        **optimizer_flags(optimizer, torch_adam=torch_adam, offload=offload_optimizer),
    }
    half = _DTYPES[dtype]
    if half is not None:
        cfg[half] = {"enabled": True}
    return cfg


def read_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A user's DeepSpeed config: a JSON file or a mapping (copied)."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {path} does not exist")
    return read_json_object(
        path, max_bytes=MAX_CONFIG_BYTES, error=lambda m: ConfigError(f"DeepSpeed config {m}")
    )


def with_optimizer(
    cfg: dict[str, Any], optimizer: OptimizerConfig, *, torch_adam: bool, offload: bool, source: str
) -> dict[str, Any]:
    """A user config without an optimizer, completed from the `optimizer` argument: its section, the flags
    DeepSpeed needs for it, and its clipping. The clipping is set explicitly because DeepSpeed's own default
    clips at 1.0, which would silently replace `grad_clip`; a config that sets another value is refused.

    >>> cfg = with_optimizer({}, OptimizerConfig(name="sgd", grad_clip=0.0), torch_adam=True, offload=False,
    ...                      source="ds.json")
    >>> cfg["optimizer"]["type"], cfg["gradient_clipping"]
    ('SGD', 0.0)
    """
    if "optimizer" in cfg:
        raise ConfigError(f"give the optimizer either as an argument or in {source}, not both")
    clip = cfg.get("gradient_clipping", optimizer.grad_clip)
    if clip != optimizer.grad_clip:
        raise ConfigError(
            f"optim.grad_clip={optimizer.grad_clip} contradicts gradient_clipping={clip!r} in {source}"
        )
    cfg["optimizer"] = optimizer_section(optimizer, torch_adam=torch_adam)
    cfg["gradient_clipping"] = optimizer.grad_clip
    for key, value in optimizer_flags(optimizer, torch_adam=torch_adam, offload=offload).items():
        cfg.setdefault(key, value)
    return cfg


def own_boundary(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Check and set the keys through which treetrain owns the accumulation boundary."""
    gas = cfg.get("gradient_accumulation_steps", 1)
    if gas not in (1, "auto"):
        raise ConfigError(
            f"{source}: gradient_accumulation_steps must be 1 (or absent): treetrain owns the accumulation "
            f"boundary and never divides by an accumulation count; got {gas!r}"
        )
    cfg["gradient_accumulation_steps"] = 1
    if cfg.get("train_micro_batch_size_per_gpu", "auto") == "auto" and "train_batch_size" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = 1
    if cfg.get("managed_gradient_accumulation", True) is not True:
        raise ConfigError(f"{source}: managed_gradient_accumulation must stay true (the default)")
    if cfg.get("gradient_allreduce_op", "mean") != "mean":
        raise ConfigError(
            f"{source}: gradient_allreduce_op must be 'mean'; the backend scales the loss instead"
        )
    if cfg.get("fp16", {}).get("enabled", False):
        raise ConfigError(
            f"{source}: fp16 is not supported: its loss scaling would scale the resident-KV gradients the "
            "tree engine accumulates; use bf16 or fp32"
        )
    if "optimizer" not in cfg:
        raise ConfigError(
            f"{source}: needs an 'optimizer' section (the backend builds DeepSpeed's optimizer)"
        )
    zero = cfg.get("zero_optimization", {})
    for key, off in (("zero_hpz_partition_size", 1), ("zero_quantized_weights", False)):
        if isinstance(zero, Mapping) and zero.get(key, off) not in (off, None):
            raise ConfigError(
                f"{source}: zero_optimization.{key} is not supported: the ZeRO-3 rendezvous "
                "(treetrain.distributed.zero3_sync) serves plain all-gathers over all ranks only"
            )
    return cfg
