"""Weights handed from the training thread to a sampler that runs beside it, at the sampler's own pace.

With `rollout.max_staleness` >= 1 the sampler keeps sampling while the trainer steps, so neither may wait for
the other, and neither may see the other's weights change under it:

- the trainer never touches the engine. After each optimizer step it copies its weights into the feed's
  *shadow*, a private copy of the policy (`publish`, on the training thread, where a gather of sharded
  weights and any other collective has to happen), and goes on training;
- the sampler takes the newest published version between its own engine steps (`sync`, called by
  `treetrain.rollout.scheduler.Scheduler` once it has interrupted the requests in flight): the engine loads
  the shadow (vLLM), or the `hf` engine's own model copies it. The interrupted samples go on under the
  newer weights with the tokens they had drawn, and each token records the version that drew it
  (`Completion.runs`).

One lock guards the shadow, so a sync never reads a half-published version and a publish never writes
weights a sync is reading. An `hf` engine samples from a model of its own, never the one being trained
halfway through a step, and never the shadow itself, which the trainer rewrites while the engine decodes:
with `shared=True` the shadow lives in shared memory and the engine's process copies it into its own model
at each sync (`treetrain.rollout.engines.hf_process`, what an asynchronous run uses); with `own_model=True`
the feed keeps that copy in this process (`sampler_model`), for an `HFEngine` on a thread.

Example:
    >>> import torch
    >>> policy = torch.nn.Linear(2, 2)
    >>> feed = WeightFeed(policy, version=0)
    >>> with torch.no_grad():
    ...     _ = policy.weight.add_(1.0)
    >>> feed.due(0), bool(torch.equal(feed.shadow.weight, policy.weight))
    (False, False)
    >>> feed.publish(policy, version=1)
    >>> feed.due(0), feed.version, bool(torch.equal(feed.shadow.weight, policy.weight))
    (True, 1, True)
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from treetrain.diskfull import SHARED_MEMORY, naming_full_disk
from treetrain.errors import TreetrainError
from treetrain.rollout.engines.generation import GenerationEngine


class SamplerStopped(TreetrainError):
    """The sampler was closed while a rollout was growing: that rollout stops (its requests are aborted)."""


def private_copy(model: Any, memo: dict[int, Any] | None = None) -> Any:
    """A copy of `model` that shares no tensor with it, in eval mode and without gradients, and without the
    hooks a training engine put on its modules (DeepSpeed's are closures: the copy must pickle to the `hf`
    sampler process, and it only ever samples or hands over weights). `memo` maps the ids of objects to
    what stands for them in the copy (`copy.deepcopy`'s memo: a sharded parameter's full-size stand-in)."""
    twin = copy.deepcopy(model, memo)
    twin.requires_grad_(False)
    for module in twin.modules():
        for hooks in _HOOKS:
            getattr(module, hooks, {}).clear()
    return twin.eval()


_HOOKS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
)  # fmt: skip
"""The hook tables of a `torch.nn.Module` that `private_copy` empties."""


@torch.no_grad()
def copy_weights(into: Any, source: Any) -> int:
    """Copy `source`'s state into `into`'s tensors in place (same architecture); the bytes copied."""
    copied = 0
    for mine, theirs in zip(into.state_dict().values(), source.state_dict().values(), strict=True):
        mine.copy_(theirs)
        copied += mine.numel() * mine.element_size()
    return copied


def settle(model: Any) -> None:
    """Wait for the copies queued on `model`'s device: on a GPU a copy only starts when it returns, and
    another process reads (or rewrites) the shared shadow as soon as the lock is released."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WeightFeed:
    """The newest published weights and their version; see the module docstring.

    `sampler_model`, when given, is the model the engine samples from (the `hf` engine's own copy): a sync
    copies the shadow into it before the engine is told the new version. Otherwise the engine loads the
    shadow itself (`GenerationEngine.sync_weights(shadow, version)`: vLLM in process or a server, or the
    `hf` engine's process, which copies the shadow in shared memory (`shared=True`) before the sync returns).
    """

    def __init__(self, model: Any, version: int, *, own_model: bool = False, shared: bool = False) -> None:
        if own_model and shared:
            raise ValueError(
                "WeightFeed: own_model (a copy in this process) or shared (a sampler process's), not both"
            )
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.shadow = self.make_shadow(model)
        self.shared = shared
        if shared:
            share_memory(self.shadow)
        self.version = version
        self.sampler_model = private_copy(model) if own_model else None
        self.syncs = 0
        """Syncs carried out, for tests and logs."""

    def make_shadow(self, model: Any) -> Any:
        """The copy of `model` that publishes write into (a subclass may build it otherwise)."""
        return private_copy(model)

    def publish(self, model: Any, version: int) -> None:
        """Copy `model`'s weights into the shadow as `version` (training thread, after the step)."""
        with self._lock:
            copy_weights(self.shadow, model)
            if self.shared:
                settle(self.shadow)
            self.version = version

    def due(self, engine_version: int) -> bool:
        """Whether newer weights than `engine_version` wait; raises `SamplerStopped` once `close` was called,
        which ends a growing rollout at its next safe point."""
        if self._closing.is_set():
            raise SamplerStopped("the sampler was closed")
        return self.version != engine_version

    def sync(self, engine: GenerationEngine) -> None:
        """Load the newest published version into `engine` (sampler thread, no request in flight)."""
        with self._lock, torch.no_grad():
            if self.sampler_model is not None:
                self.sampler_model.load_state_dict(self.shadow.state_dict())
                engine.sync_weights(self.sampler_model, self.version)
            else:
                engine.sync_weights(self.shadow, self.version)
            self.syncs += 1

    @property
    def sampling_model(self) -> Any:
        """The model an `hf` engine over this feed samples from (the shadow when the engine loads weights)."""
        return self.sampler_model if self.sampler_model is not None else self.shadow

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def close(self) -> None:
        """Make every later `due` raise `SamplerStopped` (the sampler thread stops at its next safe point)."""
        self._closing.set()


def share_memory(model: Any) -> Any:
    """`model.share_memory()`, whose tensors go to POSIX shared memory: a `/dev/shm` too small for them is
    one line naming it and the bytes needed (torch says only `unable to allocate shared memory(shm)`)."""
    needed = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    with naming_full_disk(SHARED_MEMORY, needed):
        return model.share_memory()
