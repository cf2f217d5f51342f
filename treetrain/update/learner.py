"""What one rank keeps from one update to the next: the backend, the resident store, the reference model.

`run_update` takes a `Learner` and uses it for three things, each written once, here:

- `replayer(plan, loss)`: the replayer the update's plan asks for, `TreeReplay` or the flat reference
  `FlatReference` (the one place a replayer is built from a plan), its backward routed through the backend;
- `discard()`: forget this rank's gradients of the update (after a failed backward);
- `step(...)`: the optimizer step (collective), then the next model version, after which every resident
  tensor of the old version is unreadable (`StaleResidentStateError`).

The model version counts committed updates, so it is bumped also when the backend skipped the step
(`WindowReport.step_applied` is False: DeepSpeed may skip one on overflow): the weights did not change
then, and throwing resident state away is merely wasteful, never wrong; every update's contribution keys
stay distinct.
"""

from __future__ import annotations

import dataclasses

import torch

from treetrain.distributed.backend import TrainBackend
from treetrain.distributed.placement import Placement
from treetrain.loss.loss_config import LossConfig
from treetrain.loss.manifest import Manifest
from treetrain.loss.sampler_correction import SamplerGap
from treetrain.memory.planner import Plan
from treetrain.models.lora import Reference
from treetrain.models.support import SupportGate
from treetrain.replay import FlatReference, TreeReplay
from treetrain.replay.protocols import MemoryProbe
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.resident import ResidentIdentity, ResidentStore
from treetrain.update.window_types import Replayed, WindowConfig, WindowReport


class Learner:
    """One rank's side of training across updates (see module docstring).

    `store` holds resident state under its identity (model version, adapters, tokenizer, dtype, ...); a
    fresh one at version 0 if omitted. The learner owns it from then on: each step bumps the identity and
    invalidates the store. `hooks` go to every replayer built here (tests inject faults through them), and
    `retries` bounds the retries of a failing tree and the resets of a failing backward.
    """

    def __init__(
        self,
        backend: TrainBackend,
        *,
        store: ResidentStore | None = None,
        ref_model: Reference | None = None,
        hooks: ReplayHooks | None = None,
        retries: WindowConfig | None = None,
    ) -> None:
        self.backend = backend
        self.ref_model = ref_model
        self.store = store if store is not None else ResidentStore(ResidentIdentity.of(backend.module))
        self.store.exchange = backend.context  # a context group shares each tree's resident state
        self.hooks = hooks or ReplayHooks()
        self.retries = retries or WindowConfig()
        self.support = SupportGate()
        """Remembers which models and lengths tree replay has already checked."""
        self.current_tree: str | None = None
        """The tree being replayed right now (for logs and fault-injection hooks)."""
        self.backward_calls = 0
        """Backward calls issued so far: tells a failure before a tree's first backward from one after."""

    @property
    def identity(self) -> ResidentIdentity:
        """The resident identity of the current version (the store's)."""
        return self.store.identity

    @property
    def version(self) -> int:
        """The model version: how many updates took their step, including any whose step the backend
        skipped (see the module docstring); equal to the last `WindowReport.version`."""
        return self.identity.model_version

    def replayer(
        self, plan: Plan, loss: LossConfig, tracker: MemoryProbe | None = None
    ) -> TreeReplay | FlatReference:
        """A fresh replayer for `plan`. `tracker`, if given, measures the replay by lifetime class."""
        if plan.mode == "flat":
            flat = dataclasses.replace(plan.config, microbatch=max(1, plan.microbatch))
            share = 1.0 / self.backend.context_size  # a context group's ranks replay the same calls

            def backward(loss: torch.Tensor) -> None:
                self._backward(loss if share == 1.0 else loss * share)

            return FlatReference(self.backend.module, loss, flat, ref_model=self.ref_model, backward=backward)
        hooks = dataclasses.replace(
            self.hooks, backward=self._backward, tracker=tracker or self.hooks.tracker
        )
        return TreeReplay(
            self.backend.module, loss, plan.config, ref_model=self.ref_model, store=self.store,
            support=self.support, hooks=hooks,
        )  # fmt: skip

    def _backward(self, loss: torch.Tensor) -> None:
        self.backward_calls += 1
        self.backend.backward(loss)

    def discard(self) -> None:
        """Forget this rank's gradients of the update and its resident state (local)."""
        self.backend.reset_window()
        self.store.clear()

    def step(self, manifest: Manifest, placement: Placement, replayed: Replayed) -> WindowReport:
        """The optimizer step (collective, after the coverage check), then the next model version."""
        gap = SamplerGap()  # collective, like the step: every rank's gap, summed
        for text in self.backend.gather(replayed.local.sampler_gap.encode()):
            gap = gap.merged(SamplerGap.decode(text))
        applied = self.backend.step()
        self.current_tree = None
        self.store.invalidate(self.identity.bumped())
        return WindowReport(
            version=self.version,
            manifest_digest=manifest.digest,
            contributions=len(manifest.keys()),
            local=replayed.local,
            tree_retries=replayed.tree_retries,
            window_resets=replayed.window_resets,
            dropped=replayed.dropped,
            step_applied=applied,
            rank_tokens=placement.rank_tokens,
            sampler_gap=gap,
        )
