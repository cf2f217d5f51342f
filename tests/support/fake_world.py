"""Several ranks in one process, for testing the update window's collective logic without DeepSpeed.

Each rank is a thread with its own model copy and a `ThreadRankBackend`: `gather` meets the other ranks at
a barrier, and `step` sums every rank's gradient (in rank order) before its optimizer step, as the
DeepSpeed backend's reduction does (`mean=True`: averages instead, a negative control). `FlakyBackend` fails chosen backward calls, part-way, like a real fault.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel

from treetrain.distributed import OptimizerConfig, TorchBackend

T = TypeVar("T")


class ThreadWorld:
    def __init__(self, size: int, timeout: float = 60.0) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def run(self, fns: Sequence[Callable[[], T]]) -> list[T | BaseException]:
        """Run one callable per rank in threads; each result or the exception it raised."""
        results: list[Any] = [None] * self.size

        def target(rank: int) -> None:
            try:
                results[rank] = fns[rank]()
            except BaseException as exc:  # a one-sided failure leaves the others to the barrier timeout
                results[rank] = exc

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def _explode(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("injected failure in the middle of backward")


class FlakyBackend(TorchBackend):
    """`fail_on`: backward call numbers (1-based) that raise after part of autograd already ran."""

    def __init__(
        self, model: PreTrainedModel, optimizer: OptimizerConfig, fail_on: Sequence[int] = ()
    ) -> None:
        super().__init__(model, optimizer)
        self.fail_on = set(fail_on)
        self.calls = 0

    def backward(self, loss: torch.Tensor) -> None:
        self.calls += 1
        if self.calls not in self.fail_on:
            loss.backward()
            return
        first = next(self.module.parameters())
        handle = first.register_hook(_explode)
        try:
            loss.backward()
        finally:
            handle.remove()


class ThreadRankBackend(FlakyBackend):
    def __init__(
        self,
        world: ThreadWorld,
        rank: int,
        model: PreTrainedModel,
        optimizer: OptimizerConfig,
        fail_on: Sequence[int] = (),
        mean: bool = False,
    ) -> None:
        super().__init__(model, optimizer, fail_on)
        self.world = world
        self.rank, self.world_size = rank, world.size
        self.mean = mean

    def gather(self, text: str) -> list[str]:
        return self.world.exchange(self.rank, text)

    def step(self) -> bool:
        mine = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        every = self.world.exchange(self.rank, mine)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                total = every[0][i].clone()
                for other in every[1:]:
                    total += other[i]
                p.grad = total / len(every) if self.mean else total
        return super().step()
