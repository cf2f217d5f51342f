"""The server's end of treetrain's gloo weight transfer: a vLLM `WeightTransferEngine` for CPU servers.

vLLM finds it through treetrain's `vllm.general_plugins` entry point (`register`, run in every vLLM
process) when a server is started with `--weight-transfer-config '{"backend": "treetrain_gloo"}'`. The
trainer's end, the wire layout and why are in `treetrain.rollout.engines.gloo_sender`.

Each `/update_weights` chunk is received whole into one byte buffer by a broadcast from the trainer, then
loaded by the model's `load_weights` inside vLLM's layerwise reload (`/start_weight_update` opens it,
`/finish_weight_update` processes each layer's new weights), as vLLM's NCCL engine does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from treetrain.rollout.engines.gloo_sender import (
    BACKEND,
    MAX_WORKERS,
    TIMEOUT_S,
    chunk_layout,
    open_group,
    unpack,
)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's TCP store is, and this server's place in the group (after the trainer, rank 0)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = TIMEOUT_S
    """How long a broadcast may take: the trainer's `rollout.vllm.request_timeout_s`."""

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= 86400 or not 1 <= self.rank_offset < self.world_size <= MAX_WORKERS + 1:
            raise ValueError("weight transfer: timeout_s, rank_offset or world_size out of range")


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: each tensor's checkpoint name, dtype and shape, in the order of the broadcast buffer."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("weight transfer: names, dtype_names and shapes differ in length")
        chunk_layout(self.shapes, self.dtype_names)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Dense weights broadcast over gloo from the trainer, loaded through the layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.group: object | None = None
        self.timeout_s = TIMEOUT_S

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.timeout_s = init_info.timeout_s
        self.group = open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, self.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:  # type: ignore[override]
        # the base class synchronizes the accelerator after a receive, which a CPU server has none of; the
        # broadcast is complete once its wait returns
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("weight transfer: /init_weight_transfer_engine was not called")
        _, size = chunk_layout(update_info.shapes, update_info.dtype_names)
        buf = torch.empty(size, dtype=torch.uint8)
        self.group.broadcast(buf, 0).wait(timedelta(seconds=self.timeout_s))  # type: ignore[attr-defined]
        tensors = unpack(buf, update_info.shapes, update_info.dtype_names)
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights([(n, t.to(self.device)) for n, t in zip(update_info.names, tensors)])

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """vLLM's plugin hook (`vllm.general_plugins`): make `treetrain_gloo` a weight transfer backend."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already, by an earlier load of the plugins here
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
