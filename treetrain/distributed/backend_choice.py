"""Which training backend a run gets: `make_backend` reads the trainer's distributed section.

Apart from `backend.py` (the backend contract and the one-process `TorchBackend`) so that the base module
never imports the DeepSpeed modules built on it: DeepSpeed is imported here only when a run asks for it.
"""

from __future__ import annotations

from typing import Protocol

from transformers import PreTrainedModel

from treetrain.distributed.backend import OnPoint, TorchBackend, TrainBackend
from treetrain.distributed.optim_config import OptimizerConfig
from treetrain.errors import ConfigError


class DistributedSettings(Protocol):
    """What `make_backend` reads from a trainer's distributed section."""

    @property
    def backend(self) -> str: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def offload_optimizer(self) -> bool: ...
    @property
    def deepspeed_config(self) -> str | None: ...
    @property
    def context_parallel(self) -> int: ...


def make_backend(
    model: PreTrainedModel,
    opt: OptimizerConfig,
    distributed: DistributedSettings,
    on_point: OnPoint | None = None,
) -> TrainBackend:
    """The backend a trainer config asks for. A DeepSpeed JSON, when given, decides the ZeRO stage and
    offload (and the optimizer, if it has an optimizer section); DeepSpeed is imported only here.
    `on_point` reaches the torch backend's checkpoint write (`TorchBackend`); DeepSpeed's has no point."""
    if distributed.backend == "torch":
        if distributed.context_parallel != 1:
            raise ConfigError("distributed.context_parallel > 1 needs distributed.backend: deepspeed")
        return TorchBackend(model, opt, on_point=on_point)
    if distributed.backend != "deepspeed":
        raise ConfigError(f"distributed.backend must be 'torch' or 'deepspeed', got {distributed.backend!r}")
    from treetrain.distributed.context_groups import join_context_group
    from treetrain.distributed.deepspeed_backend import DeepSpeedBackend
    from treetrain.distributed.deepspeed_config import read_config

    if distributed.deepspeed_config is None:
        backend = DeepSpeedBackend(
            model,
            zero_stage=distributed.zero_stage,
            offload_optimizer=distributed.offload_optimizer,
            optimizer=opt,
            dtype=next(model.parameters()).dtype,
        )
    else:
        has_optimizer = "optimizer" in read_config(distributed.deepspeed_config)
        backend = DeepSpeedBackend(
            model, ds_config=distributed.deepspeed_config, optimizer=None if has_optimizer else opt
        )
    return join_context_group(backend, distributed.context_parallel)
