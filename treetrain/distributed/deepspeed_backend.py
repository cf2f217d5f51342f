"""`DeepSpeedBackend`: ZeRO 0-3, optional optimizer CPU offload, across processes.

With `zero3_sync`, the only modules that import DeepSpeed.

treetrain owns the accumulation boundary. Ranks replay different trees, so they run different numbers of
backward calls, and a backward may reach only some parameters (an internal node's KV recompute never
touches the LM head). DeepSpeed's default schedule assumes the opposite: every backward is a micro-step
of a fixed `gradient_accumulation_steps`, divided by it, and ZeRO-2/3 reduce gradients inside each
backward. Used naively that drops micro-steps (ZeRO-1/2 with GAS=1 keep only the last backward), leaves
the last micro-batch out (a boundary set before it), or deadlocks (ranks issue different collectives).
So this backend:

- keeps `gradient_accumulation_steps` at 1 and calls `engine.backward(loss, scale_wrt_gas=False)`;
- opens one reduction window per update: `engine.coalesce_grad_reduction()` (ZeRO 1-3) or
  `engine.no_sync()` (ZeRO 0), so a backward only accumulates locally and no collective runs until
  `step()`;
- at `step()` gives every parameter a gradient (an exact zero where this rank had none), so every rank
  reduces the same tensors in the same order, closes the window (one reduction pass) and steps;
- multiplies the local gradients by the data-parallel world size just before that reduction, because
  DeepSpeed averages over ranks and the manifest already normalizes the global sum
  (`gradient_allreduce_op='sum'` is not available under ZeRO-3). The loss itself is never scaled: in
  `exact` mode the tree engine reads the gradient of its own resident-KV leaves after each backward, and
  a scaled loss would scale that too (which is also why fp16 loss scaling is refused);
- in float64 (ZeRO 0 only: DeepSpeed's reduction takes no float64 gradient, and ZeRO 1-2 would reduce
  them in float32), sums the gradients over the ranks itself, one flat float64 all-reduce, and leaves
  DeepSpeed the step;
- under ZeRO-3, keeps the parameters partitioned through the window: DeepSpeed's own per-module
  fetch/release hooks gather each module's parameters when it runs and release them after, and a
  `FetchRendezvous` (`treetrain.distributed.zero3_sync`) makes every one of those all-gathers a
  rendezvous of all ranks, so ranks replaying different trees still issue the same collectives. A rank
  holds its partition plus the modules in flight. Gradients accumulate unpartitioned on each rank until
  the step (the reduction is deferred to the window's end, as under ZeRO 1 and 2), then are reduced
  and partitioned. `uneven()` opens the same rendezvous for other per-rank work (rollouts).

The optimizer is AdamW or plain SGD (`OptimizerConfig.name`; SGD checked under ZeRO 0-3, with and without
offload). Checkpoints are read back with weights-only unpickling (`WeightsOnlyReads`), never with
DeepSpeed's default `torch.load(weights_only=False)`.

Example (under `torchrun` or `deepspeed`):
    >>> backend = DeepSpeedBackend(model, zero_stage=3, optimizer=OptimizerConfig(lr=1e-6))  # doctest: +SKIP
    >>> backend.begin_window(); backend.backward(loss); backend.step()                      # doctest: +SKIP
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
from transformers import PreTrainedModel

from treetrain.distributed.backend import TrainBackend
from treetrain.distributed.checkpoint_io import (
    CheckpointError,
    read_client_state,
    write_client_state,
)
from treetrain.distributed.deepspeed_config import (
    FLOAT64_STAGES,
    config_offload,
    config_zero_stage,
    default_config,
    own_boundary,
    read_config,
    with_optimizer,
)
from treetrain.distributed.optim_config import OptimizerConfig
from treetrain.distributed.zero3_sync import DirectReads, FetchRendezvous
from treetrain.errors import ConfigError
from treetrain.io import atomic_directory
from treetrain.models.lora import is_peft, save_adapter

TAG = "deepspeed"
"""Sub-directory (DeepSpeed's checkpoint tag) holding DeepSpeed's own files inside a checkpoint."""
CHECKPOINT_GLOBALS: list[Any] = [LossScaler, ZeroStageEnum, fragment_address]
"""The only non-tensor classes in DeepSpeed 0.19's ZeRO 0-3 checkpoints (fp32 or bf16, with or without
offload); `load_checkpoint` allows these and nothing else when it unpickles."""


class WeightsOnlyReads:
    """A DeepSpeed checkpoint engine whose reads are `torch.load(weights_only=True)`.

    DeepSpeed's own engines unpickle with `weights_only=False`, which runs arbitrary code from the file.
    Every other call goes to the wrapped engine. Reads allow tensors, primitive containers and
    `CHECKPOINT_GLOBALS` only; anything else raises `pickle.UnpicklingError` naming the class.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(CHECKPOINT_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class DeepSpeedBackend(TrainBackend):
    """A DeepSpeed engine driven with an explicit, caller-owned accumulation boundary."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        ds_config: str | Path | Mapping[str, Any] | None = None,
        zero_stage: int | None = None,
        offload_optimizer: bool | None = None,
        optimizer: OptimizerConfig | None = None,
        dtype: torch.dtype = torch.float32,
        measure_params: bool = False,
    ) -> None:
        """`ds_config` (a JSON path or a mapping) wins; without it the config is generated from `zero_stage`
        (default 2), `offload_optimizer`, `optimizer` and `dtype`. Arguments that contradict a given
        `ds_config` are refused. Adam is torch's own on the CPU accelerator, where DeepSpeed's fused and
        CPU Adam kernels are not built. The process group is initialized with the accelerator's
        communication backend (gloo on CPU) unless one exists already. `measure_params` makes the ZeRO-3
        rendezvous record the parameter bytes it gathers (`FetchRendezvous`)."""
        torch_adam = get_accelerator().device_name() == "cpu"
        if ds_config is None:
            cfg = default_config(
                zero_stage=2 if zero_stage is None else zero_stage,
                offload_optimizer=bool(offload_optimizer),
                optimizer=optimizer or OptimizerConfig(),
                dtype=dtype,
                torch_adam=torch_adam,
            )
            source = "generated DeepSpeed config"
        else:
            cfg = read_config(ds_config)
            source = f"DeepSpeed config {ds_config if not isinstance(ds_config, Mapping) else '(mapping)'}"
            stage = config_zero_stage(cfg)
            if zero_stage is not None and zero_stage != stage:
                raise ConfigError(f"zero_stage={zero_stage} contradicts {source} (stage {stage})")
            offloaded = config_offload(cfg)
            if offload_optimizer is not None and offload_optimizer != offloaded:
                raise ConfigError(f"offload_optimizer={offload_optimizer} contradicts {source}")
            if optimizer is not None:
                cfg = with_optimizer(cfg, optimizer, torch_adam=torch_adam, offload=offloaded, source=source)
        self.config = own_boundary(cfg, source)
        params = [p for p in model.parameters() if p.requires_grad]
        self._sums_float64 = any(p.dtype == torch.float64 for p in params)
        """Whether this backend reduces the gradients itself (float64, which DeepSpeed does not reduce)."""
        if self._sums_float64 and config_zero_stage(self.config) != 0:
            raise ConfigError(
                f"model.dtype float64 at ZeRO-{config_zero_stage(self.config)} ({source}): {FLOAT64_STAGES}"
            )
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        engine, *_ = deepspeed.initialize(model=model, config=self.config, model_parameters=params)
        self.engine = engine
        self.module = engine.module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._stage = int(engine.zero_optimization_stage())
        self._offload = bool(engine.zero_use_cpu_optimizer())
        self._window: AbstractContextManager[Any] | None = None
        self.rendezvous = (
            FetchRendezvous(engine, measure=measure_params)
            if self._stage == 3 and self.world_size > 1
            else None
        )
        """Under ZeRO-3 on several ranks: the all-gather rendezvous (see `zero3_sync`), else None."""
        direct = DirectReads(self.module)
        self._direct = direct if self._stage == 3 and direct.params else None
        """Under ZeRO-3, for a model with any: the weights read outside their module's forward, held
        gathered while a window or an uneven region is open (see `zero3_sync.DirectReads`)."""

    @property
    def zero_stage(self) -> int:
        """The stage DeepSpeed's engine runs (from the generated config or the user's JSON)."""
        return self._stage

    @property
    def offload_optimizer(self) -> bool:
        """Whether the engine offloads optimizer state (to CPU or NVMe)."""
        return self._offload

    # ----- the update window ------------------------------------------------------------------------
    @property
    def in_window(self) -> bool:
        return self._window is not None

    def begin_window(self) -> None:
        if self._window is not None:
            return
        if self.rendezvous is not None:
            self.rendezvous.install()
        if self._direct is not None:
            self._direct.hold()
        window = self.engine.no_sync() if self._stage == 0 else self.engine.coalesce_grad_reduction()
        window.__enter__()
        self._window = window

    def backward(self, loss: torch.Tensor) -> None:
        if self._window is None:
            raise RuntimeError(
                "DeepSpeedBackend.backward outside an update window: call begin_window() on every rank"
            )
        if isinstance(self.engine.optimizer, ZeROOptimizer):
            self.engine.optimizer.clear_backward_seen_flag()  # what engine.forward does per micro-step
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> bool:
        self.begin_window()
        if self.rendezvous is not None:
            self.rendezvous.drain()
            self.rendezvous.uninstall()
        if self._direct is not None:
            self._direct.release()
        self._give_every_param_a_grad()  # every rank reduces every param
        if not self._sums_float64:
            self._scale_local_grads(float(self.engine.dp_world_size))  # DeepSpeed's mean becomes the sum
        assert self._window is not None
        self._window.__exit__(None, None, None)
        self._window = None
        if self._sums_float64:
            self._sum_grads()
        elif self._stage == 0:
            self.engine.allreduce_gradients()
        self.engine.step()
        return bool(self.engine.was_step_applied())

    @contextmanager
    def uneven(self) -> Iterator[None]:
        """A region where ranks may run different forwards (e.g. rollouts of different lengths).

        Under ZeRO-3 each parameter fetch is a rendezvous of all ranks (see `zero3_sync`); leaving the
        region waits for every rank (a collective). Elsewhere it does nothing. Inside an update window the
        rendezvous is already on.
        """
        sync, direct = self.rendezvous, self._direct
        if (sync is None or sync.active) and (direct is None or direct.held):
            yield
            return
        if sync is not None:
            sync.install()
        if direct is not None:
            direct.hold()  # after the rendezvous: every rank is here, at the region's collective start
        try:
            yield
        finally:
            if sync is not None:
                sync.drain()
                sync.uninstall()
            if direct is not None:
                direct.release()
            self._settle_zero3()

    def _settle_zero3(self) -> None:
        """Every parameter partitioned, then DeepSpeed's persistent ones gathered again, on every rank:
        the state DeepSpeed's own collectives (export, checkpoint, step) expect outside a forward."""
        opt = self.engine.optimizer
        opt.parameter_offload.partition_all_parameters()
        persistent = list(getattr(opt, "persistent_parameters", []))
        if persistent:
            persistent[0].all_gather(persistent)

    def _give_every_param_a_grad(self) -> None:
        """An exact zero gradient for every trainable parameter this rank's backwards never reached."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self._stage != 3:
            self.backward(torch.stack([(p * 0).sum() for p in params]).sum())
            return
        with torch.no_grad():  # partitioned: p.data is empty, the gradient has the full shape
            for p in params:
                if p.grad is not None:
                    continue
                held = p.data
                shape = p.ds_shape  # type: ignore[attr-defined]
                p.data = torch.empty(shape, dtype=p.dtype, device=held.device)
                p.grad = torch.zeros_like(p.data)
                p.data = held

    @property
    def param_peak_bytes(self) -> int:
        """Under ZeRO-3 with `measure_params`: the largest parameter storage (this rank's partitions plus
        gathered tensors) seen inside update windows since `reset_param_peak`; else 0."""
        return self.rendezvous.peak_param_bytes if self.rendezvous is not None else 0

    def reset_param_peak(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.reset_peak()

    def reset_window(self) -> None:
        opt = self.engine.optimizer
        hooks = getattr(opt, "_backward_hook_state", None)
        while hooks is not None and hooks.backward_active_depth > 0:  # a backward that raised never exited
            opt.exit_backward()
        if isinstance(opt, ZeROOptimizer):
            opt.clear_backward_seen_flag()
        for p in self.module.parameters():
            p.grad = None
            if getattr(p, "grad_accum", None) is not None:
                p.grad_accum = None  # type: ignore[attr-defined]

    def set_learning_rate(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def _sum_grads(self) -> None:
        """Every rank's gradients summed, in the parameters' dtype: one flat all-reduce over the group
        DeepSpeed's own stage-0 reduction uses (the whole world: a context group's ranks hold partial sums)."""
        grads = [p.grad for p in self.module.parameters() if p.requires_grad and p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.engine.seq_data_parallel_group)
        with torch.no_grad():
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _scale_local_grads(self, factor: float) -> None:
        """Scale what this rank accumulated, wherever DeepSpeed parks it inside the window."""
        with torch.no_grad():
            for p in self.module.parameters():
                for grad in (p.grad, getattr(p, "grad_accum", None)):
                    if grad is not None:
                        grad.mul_(factor)

    # ----- collectives ------------------------------------------------------------------------------
    def gather(self, text: str) -> list[str]:
        """All ranks' strings, moved as bytes tensors (nothing is pickled)."""
        if self.rendezvous is not None:
            self.rendezvous.drain()
        device = get_accelerator().current_device_name()
        data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        if longest == 0:
            return [""] * self.world_size
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        parts = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return [bytes(p[: int(s.item())].tolist()).decode() for p, s in zip(parts, sizes)]

    def barrier(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.drain()
        dist.barrier()

    # ----- checkpoints ------------------------------------------------------------------------------
    def _token(self) -> str:
        return self.gather(uuid.uuid4().hex[:12] if self.rank == 0 else "")[0]

    def save_checkpoint(self, directory: str | Path, client_state: Mapping[str, Any]) -> None:
        if self._window is not None:
            raise RuntimeError("save_checkpoint inside an update window; save after step()")
        with atomic_directory(
            Path(directory), token=self._token(), writer=self.rank == 0, barrier=self.barrier
        ) as tmp:
            self.engine.save_checkpoint(str(tmp), tag=TAG, client_state={}, save_latest=False)
            if self.rank == 0:
                write_client_state(tmp, client_state)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore weights and optimizer state with weights-only unpickling (see `WeightsOnlyReads`).

        A checkpoint holding any other class is refused with `CheckpointError` on every rank that reads
        it. Ranks must pass the same directory (a collective, like DeepSpeed's own load).
        """
        state = read_client_state(Path(directory))
        inner = self.engine.checkpoint_engine
        self.engine.checkpoint_engine = WeightsOnlyReads(inner)
        try:
            path, _ = self.engine.load_checkpoint(str(directory), tag=TAG)
        except pickle.UnpicklingError as exc:
            why = next((line.strip() for line in str(exc).splitlines() if "Unsupported global" in line), exc)
            raise CheckpointError(
                f"{directory}: refused by weights-only loading (not a checkpoint this code wrote?): {why}"
            ) from exc
        finally:
            self.engine.checkpoint_engine = inner
        if path is None:
            raise CheckpointError(f"{directory}: no DeepSpeed checkpoint under tag {TAG!r}")
        return state

    def export_pretrained(self, directory: str | Path, tokenizer: Any = None) -> None:
        if self._window is not None:
            raise RuntimeError("export_pretrained inside an update window; export after step()")
        gathered = (
            deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)
            if self._stage == 3
            else nullcontext()
        )
        with gathered:
            if self.rank == 0:
                with atomic_directory(Path(directory)) as tmp:
                    weights = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
                    if is_peft(self.module):
                        save_adapter(self.module, Path(tmp), state_dict=weights)
                    else:
                        self.module.save_pretrained(tmp, state_dict=weights)
                    if tokenizer is not None:
                        tokenizer.save_pretrained(tmp)
        self.barrier()
