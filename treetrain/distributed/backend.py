"""The training backend: where gradients accumulate and the optimizer steps.

The update window (`treetrain.update.window`) talks to a `TrainBackend` only. It forwards
`backend.module`, calls `backward(loss)` once per replay step, any number of times, and `step()` once when
the whole manifest is covered. Two implementations:

- `TorchBackend`: one process, `torch.optim.AdamW` (or plain SGD, see `OptimizerConfig.name`). The CPU
  demo and the single-process references of the distributed tests use it.
- `DeepSpeedBackend` (`treetrain.distributed.deepspeed_backend`, the one module that imports DeepSpeed):
  ZeRO 0-3 with optional optimizer offload, across processes.

Contract shared by both: `backward` only accumulates (never scaled by any accumulation-step count, never
reduced across ranks), so ranks may run different numbers of backward calls; `step` reduces once (the sum
over ranks), applies the update and zeroes the gradients; `reset_window` discards what this rank
accumulated since the last step, without talking to other ranks.

Example:
    >>> backend = TorchBackend(model, OptimizerConfig(lr=1e-5))     # doctest: +SKIP
    >>> backend.backward(loss_a); backend.backward(loss_b)           # doctest: +SKIP
    >>> backend.step()                                               # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from transformers import PreTrainedModel

from treetrain.distributed.checkpoint_io import read_client_state, write_client_state
from treetrain.distributed.optim_config import OptimizerConfig
from treetrain.errors import TreetrainError
from treetrain.io import atomic_directory
from treetrain.models.context_exchange import ContextExchange
from treetrain.models.lora import is_peft, save_adapter

OnPoint = Callable[[str, int | None], None]
"""A hook a run calls at a named point (`"checkpoint-write"`, `"update-end"`) with the update's index.
Interruption tests pass one that stops the process there, to kill it at a known moment; a run without
one (every real run) calls nothing."""


class AgreementError(TreetrainError, RuntimeError):
    """Ranks hold different values where they must agree (version, manifest, placement, coverage)."""


def torch_optimizer(params: Sequence[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The plain-torch optimizer `cfg` names, over `params`."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def disagreement(values: Sequence[str], what: str) -> str | None:
    """None when every rank holds the same value, else a message naming the ranks that differ."""
    if all(v == values[0] for v in values):
        return None
    groups: dict[str, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    majority, agreeing = max(groups.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))
    odd = sorted(r for v, ranks in groups.items() if v != majority for r in ranks)
    shown = "; ".join(f"rank {r} has {values[r][:200]!r}" for r in odd[:4])
    return f"ranks disagree on the {what}: ranks {odd} differ from ranks {agreeing} ({majority[:200]!r}); {shown}"


class TrainBackend(ABC):
    """Gradient accumulation, reduction, optimizer step and checkpoints (see module docstring)."""

    module: PreTrainedModel
    rank: int
    world_size: int
    context: ContextExchange | None = None
    """This rank's context group (`distributed.context_parallel` ranks sharing each tree's resident state;
    `treetrain.distributed.context_groups`), or None: every rank its own."""

    @property
    def context_size(self) -> int:
        """C, the ranks of a context group (1 without one); the world is data groups x C."""
        return 1 if self.context is None else self.context.size

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage really in effect (0: no partitioning), e.g. for the memory planner. For
        DeepSpeed it is read from the engine, so a user's DeepSpeed JSON is reflected too."""
        return 0

    @property
    def offload_optimizer(self) -> bool:
        """Whether optimizer state (and the update) lives off the accelerator (DeepSpeed's optimizer
        offload to CPU or NVMe)."""
        return False

    def begin_window(self) -> None:
        """Called on every rank before the first backward of an update window (a collective)."""
        return None

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate d(loss)/d(params) locally; never scaled, never reduced here.

        The loss must not be scaled either: the tree engine reads the gradients of its own leaf tensors
        (resident KV) after each backward and feeds them into later losses.
        """

    @abstractmethod
    def step(self) -> bool:
        """Reduce (sum over ranks), apply the update, zero gradients; False if the update was skipped."""

    @abstractmethod
    def reset_window(self) -> None:
        """Discard this rank's gradients accumulated since the last step (after a failed backward)."""

    @abstractmethod
    def set_learning_rate(self, lr: float) -> None:
        """Learning rate of the next step (warm-up and schedules live in the trainer)."""

    @abstractmethod
    def gather(self, text: str) -> list[str]:
        """Every rank's `text`, indexed by rank (a collective: all ranks must call it)."""

    def agree(self, text: str, what: str = "value") -> None:
        """Raise `AgreementError` on every rank unless all ranks passed the same `text`."""
        problem = disagreement(self.gather(text), what)
        if problem is not None:
            raise AgreementError(problem)

    def barrier(self) -> None:
        self.gather("")

    @contextlib.contextmanager
    def uneven(self) -> Iterator[None]:
        """A region where ranks may run different forwards (rollouts of different lengths): under ZeRO-3
        the DeepSpeed backend makes each parameter fetch a rendezvous of all ranks there, and leaving the
        region is a collective. Nothing to do for other backends."""
        yield

    @contextlib.contextmanager
    def scratch(self) -> Iterator[None]:
        """Open the update window for passes whose gradients must never reach the optimizer.

        Memory calibration runs real backward passes on the model; under DeepSpeed they would otherwise
        trigger gradient reduction outside a window. Everything accumulated inside is discarded; the window
        stays open for the update that follows. A collective when the backend's window is.
        """
        self.begin_window()
        try:
            yield
        finally:
            self.reset_window()

    @abstractmethod
    def save_checkpoint(self, directory: str | Path, client_state: Mapping[str, Any]) -> None:
        """Weights, optimizer state and `client_state` (a JSON object), written atomically."""

    @abstractmethod
    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore weights and optimizer state; returns the saved client state."""

    @abstractmethod
    def export_pretrained(self, directory: str | Path, tokenizer: Any = None) -> None:
        """A Hugging Face `save_pretrained` directory of the current weights, written atomically."""


class TorchBackend(TrainBackend):
    """One process, a plain torch optimizer (`OptimizerConfig.name`)."""

    MODEL_FILE = "model.safetensors"
    OPTIMIZER_FILE = "optimizer.pt"

    def __init__(
        self,
        model: PreTrainedModel,
        optimizer: OptimizerConfig = OptimizerConfig(),
        *,
        on_point: OnPoint | None = None,
    ) -> None:
        """`on_point`, if given, is called inside each checkpoint write, between the weights and the
        optimizer state (`"checkpoint-write"`)."""
        self.module = model
        self.on_point = on_point
        self.rank, self.world_size = 0, 1
        self.cfg = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch_optimizer(self.params, optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> bool:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"gradient norm is {float(norm)}; the step is refused and the window discarded"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def reset_window(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def gather(self, text: str) -> list[str]:
        return [text]

    def save_checkpoint(self, directory: str | Path, client_state: Mapping[str, Any]) -> None:
        with atomic_directory(Path(directory)) as tmp:
            save_model(self.module, str(tmp / self.MODEL_FILE))
            if self.on_point is not None:
                self.on_point("checkpoint-write", client_state.get("update"))
            torch.save(self.optimizer.state_dict(), tmp / self.OPTIMIZER_FILE)
            write_client_state(tmp, client_state)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        directory = Path(directory)
        state = read_client_state(directory)
        load_model(self.module, str(directory / self.MODEL_FILE))
        # on the CPU first: a run saved on a GPU resumes anywhere (the optimizer moves its state to the params)
        opt_state = torch.load(directory / self.OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(opt_state)
        return state

    def export_pretrained(self, directory: str | Path, tokenizer: Any = None) -> None:
        with atomic_directory(Path(directory)) as tmp:
            if is_peft(self.module):
                save_adapter(self.module, Path(tmp))
            else:
                self.module.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
