"""The DeepSpeed config the backend builds or accepts: treetrain owns the accumulation boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from treetrain.distributed import OptimizerConfig
from treetrain.distributed.deepspeed_config import (
    config_offload,
    config_zero_stage,
    default_config,
    own_boundary,
    read_config,
    with_optimizer,
)
from treetrain.errors import ConfigError


def test_generated_default_from_explicit_arguments() -> None:
    opt = OptimizerConfig(lr=2e-6, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=0.5)
    cfg = default_config(
        zero_stage=3, offload_optimizer=True, optimizer=opt, dtype=torch.bfloat16, torch_adam=True
    )
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
    }
    assert cfg["optimizer"]["params"] == {
        "lr": 2e-6,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "torch_adam": True,
    }
    assert cfg["bf16"] == {"enabled": True} and cfg["zero_force_ds_cpu_optimizer"] is False
    assert own_boundary(cfg, "generated") is cfg


def test_generated_sgd_is_plain_torch_sgd() -> None:
    """DeepSpeed builds torch.optim.SGD from a type it does not implement; offload needs no CPU-Adam flag."""
    opt = OptimizerConfig(name="sgd", lr=0.5, weight_decay=0.0, grad_clip=0.0)
    cfg = default_config(
        zero_stage=2, offload_optimizer=True, optimizer=opt, dtype=torch.float32, torch_adam=True
    )
    assert cfg["optimizer"] == {"type": "SGD", "params": {"lr": 0.5, "weight_decay": 0.0}}
    assert cfg["gradient_clipping"] == 0.0 and cfg["zero_allow_untested_optimizer"] is True
    assert "zero_force_ds_cpu_optimizer" not in cfg


@pytest.mark.parametrize(
    ("cfg", "stage", "offload"),
    [
        ({}, 0, False),
        ({"zero_optimization": {"stage": 3}}, 3, False),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 2, True),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, 3, True),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}}, 1, False),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {}}}, 1, False),
    ],
)
def test_stage_and_offload_read_from_a_user_config(cfg: dict, stage: int, offload: bool) -> None:
    assert (config_zero_stage(cfg), config_offload(cfg)) == (stage, offload)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3"),
        ({"zero_stage": 0, "offload_optimizer": True}, "offload_optimizer needs ZeRO stage 1, 2 or 3"),
        ({"dtype": torch.float16}, "dtype must be one of"),
        (
            {"dtype": torch.float64, "zero_stage": 1},
            "float64 at ZeRO-1: DeepSpeed reduces gradients in float32",
        ),
        ({"dtype": torch.float64, "zero_stage": 3}, "float64 at ZeRO-3: .*distributed.zero_stage=0"),
    ],
)
def test_generated_default_refuses_bad_arguments(kwargs: dict, message: str) -> None:
    args = {
        "zero_stage": 2,
        "offload_optimizer": False,
        "optimizer": OptimizerConfig(),
        "dtype": torch.float32,
        "torch_adam": True,
    }
    with pytest.raises(ConfigError, match=message):
        default_config(**{**args, **kwargs})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps must be 1"),
        ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation must stay true"),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op must be 'mean'"),
        ({"fp16": {"enabled": True}}, "fp16 is not supported"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "zero_hpz_partition_size"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights"),
    ],
)
def test_user_config_that_would_scale_or_drop_gradients_is_refused(override: dict, message: str) -> None:
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": {"stage": 2},
        **override,
    }
    with pytest.raises(ConfigError, match=message):
        own_boundary(cfg, "ds.json")


def test_user_config_gets_the_boundary_keys(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "zero_optimization": {"stage": 1}}
        )
    )
    cfg = own_boundary(read_config(path), str(path))
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["train_micro_batch_size_per_gpu"] == 1
    with pytest.raises(ConfigError, match="needs an 'optimizer' section"):
        own_boundary({"zero_optimization": {"stage": 1}}, "ds.json")


def test_unreadable_user_config_names_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "zero_optimization": {"stage": 2,}\n}')
    with pytest.raises(ConfigError, match=r"bad\.json: invalid JSON at line 2"):
        read_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        read_config(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ConfigError, match="top level must be an object"):
        read_config(tmp_path / "list.json")


def test_user_config_takes_the_optimizer_arguments_clipping() -> None:
    """DeepSpeed clips at 1.0 when a config names no `gradient_clipping`: the argument's value is written in,
    and a config that sets another one is refused rather than silently winning or losing."""
    sgd = OptimizerConfig(name="sgd", lr=0.5, weight_decay=0.0, grad_clip=0.0)
    cfg = with_optimizer(
        {"zero_optimization": {"stage": 1}}, sgd, torch_adam=True, offload=False, source="ds"
    )
    assert cfg["gradient_clipping"] == 0.0 and cfg["optimizer"]["type"] == "SGD"
    same = with_optimizer({"gradient_clipping": 0.0}, sgd, torch_adam=True, offload=False, source="ds")
    assert same["gradient_clipping"] == 0.0
    with pytest.raises(ConfigError, match=r"optim.grad_clip=0.0 contradicts gradient_clipping=1.0 in ds"):
        with_optimizer({"gradient_clipping": 1.0}, sgd, torch_adam=True, offload=False, source="ds")
    with pytest.raises(ConfigError, match="either as an argument or in ds, not both"):
        with_optimizer({"optimizer": {"type": "SGD"}}, sgd, torch_adam=True, offload=False, source="ds")


def test_float64_runs_at_zero_0_where_treetrain_reduces_it() -> None:
    """DeepSpeed's own reduction takes no float64 gradient, so treetrain sums them itself at ZeRO 0
    (`DeepSpeedBackend._sum_grads`); the config is a plain one, with no half-precision section."""
    cfg = default_config(
        zero_stage=0,
        offload_optimizer=False,
        optimizer=OptimizerConfig(),
        dtype=torch.float64,
        torch_adam=True,
    )
    assert cfg["zero_optimization"] == {"stage": 0} and "bf16" not in cfg and "fp16" not in cfg


def test_a_float64_model_under_a_user_config_of_zero_2_is_refused_before_deepspeed_starts() -> None:
    from treetrain.distributed.deepspeed_backend import DeepSpeedBackend
    from treetrain.models.presets import tiny_model

    model = tiny_model("llama", 64, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"float64 at ZeRO-2 \(DeepSpeed config \(mapping\)\)") as caught:
        DeepSpeedBackend(model, ds_config={"zero_optimization": {"stage": 2}}, optimizer=OptimizerConfig())
    assert "\n" not in str(caught.value)
