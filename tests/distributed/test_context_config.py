"""`distributed.context_parallel` is checked before any process group or model exists: a bad value, the
one-process backend, or a C that does not divide the world each get one clear error."""

from __future__ import annotations

import pytest

from treetrain.distributed.context_groups import check_context_size, context_exchange
from treetrain.errors import ConfigError
from treetrain.train.config import load_config


def test_default_is_one_group_per_rank() -> None:
    cfg = load_config(None)
    assert cfg.distributed.context_parallel == 1
    assert context_exchange(rank=0, world_size=1, size=1) is None  # no group, no collective


@pytest.mark.parametrize("value", ["0", "-2", "true", "1.5", "5000"])
def test_bad_values_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="context_parallel"):
        load_config(None, ["distributed.backend=deepspeed", f"distributed.context_parallel={value}"])


def test_torch_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"need distributed\.backend: deepspeed"):
        load_config(None, ["distributed.context_parallel=2"])
    cfg = load_config(None, ["distributed.backend=deepspeed", "distributed.context_parallel=2"])
    assert cfg.distributed.context_parallel == 2


def test_size_must_divide_the_world() -> None:
    check_context_size(2, 8)
    with pytest.raises(ConfigError, match="does not divide the world of 6"):
        check_context_size(4, 6)


def test_float64_under_deepspeed_is_refused_above_zero_0_at_load() -> None:
    """DeepSpeed reduces float64 gradients in float32 at ZeRO 1-2 and refuses them at ZeRO-3; at ZeRO 0
    treetrain reduces them itself, so a group's update can be checked in float64."""
    float64 = ["distributed.backend=deepspeed", "model.dtype=float64", "distributed.context_parallel=2"]
    for stage in (1, 2, 3):
        with pytest.raises(ConfigError, match=f"distributed.zero_stage: {stage} with model.dtype float64"):
            load_config(None, [*float64, f"distributed.zero_stage={stage}"])
    assert load_config(None, [*float64, "distributed.zero_stage=0"]).model.dtype == "float64"
