"""The reference model's logprobs for the KL term, scored over the same tree as the policy.

A reference that is the policy with its adapters off (`AdaptersOff`) is scored in the policy's own scoring
walk (`fused_reference_walk`): at every batch the policy's forward runs, then the reference's on the same
tokens against its own store. Any other reference, or a plan that asks for it, takes a walk of its own
after the policy's (`separate_reference_logprobs`), holding less at once. Either way the reference's
store has the identity the model has inside `adapters_disabled` (adapters 'off'), so its KV is never read
as the policy's, nor the policy's as its. In a context group the reference's resident state is sharded as
the policy's is (`ReferenceView.shards`): each rank keeps the units it owns, and every rank computes the
same logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treetrain.loss.loss_config import LossConfig
from treetrain.models.lora import AdaptersOff, Reference, adapters_disabled
from treetrain.replay.batch import ReplayConfig
from treetrain.replay.context_replay import ContextShards
from treetrain.replay.protocols import MemoryProbe
from treetrain.replay.resident import ResidentIdentity, ResidentStore
from treetrain.replay.scoring import (
    LogitSettings,
    PathKV,
    ReferenceWalk,
    ScoreBatch,
    reference_need,
    scoring_pass,
)
from treetrain.replay.units import UnitTree


def fused_reference(loss: LossConfig, replay: ReplayConfig, ref_model: Reference | None) -> bool:
    """Whether the reference's logprobs come from the scoring walk itself: KL is on, there is a scoring pass
    (`loss.ratio_source='scoring'`), the reference is the policy with its adapters off, and the replay
    config does not ask for a separate walk (the planner does when both KV sets do not fit)."""
    return (
        loss.needs_reference
        and loss.ratio_source == "scoring"
        and isinstance(ref_model, AdaptersOff)
        and replay.reference_walk == "fused"
    )


@dataclass(frozen=True)
class ReferenceView:
    """What a reference walk needs of the engine running it."""

    tokenizer: str
    """The policy identity's tokenizer fingerprint (the reference shares the tokenizer)."""
    device: torch.device
    score_microbatch: int
    max_logit_elements: int
    temperature: float
    """The loss's `logit_temperature`: the reference is scored at the policy's temperature (as in TRL and
    verl), so the KL compares the two distributions the loss sees."""
    tracker: MemoryProbe | None
    """Told about the reference's store, so its KV is measured with the rest."""
    mark: Callable[[ScoreBatch], None]
    """Called before each reference batch (the memory tracker's event labels)."""
    shards: ContextShards | None = None
    """The policy's context group, which holds the reference's resident state too (None without one)."""

    def store(self, ref: PreTrainedModel) -> tuple[ResidentStore, ResidentIdentity]:
        identity = ResidentIdentity.of(ref, tokenizer=self.tokenizer)
        store = ResidentStore(identity)
        if self.tracker is not None:
            self.tracker.attach_store(store)
        return store, identity


def fused_reference_walk(ref_model: Reference, units: UnitTree, view: ReferenceView) -> ReferenceWalk:
    """The reference's half of a fused scoring walk, over its own store (emptied by the caller)."""
    with adapters_disabled(ref_model) as ref:
        store, identity = view.store(ref)
    return ReferenceWalk(
        PathKV(ref, units, store, identity, view.device, shards=view.shards),
        enter=lambda: adapters_disabled(ref_model),
        before_batch=view.mark,
    )


def separate_reference_logprobs(
    ref_model: Reference, units: UnitTree, view: ReferenceView
) -> tuple[list[torch.Tensor | None], int]:
    """The reference's logprobs (`[M_u]` per unit) from a walk of its own, and the tokens it ran."""
    with adapters_disabled(ref_model) as ref:
        store, identity = view.store(ref)
        paths = PathKV(ref, units, store, identity, view.device, shards=view.shards)
        lps, n_tok = scoring_pass(
            paths, microbatch=view.score_microbatch, need=reference_need(units),
            keep=lambda u: False, logits=LogitSettings(view.max_logit_elements, view.temperature),
            before_batch=view.mark,
        )  # fmt: skip
        store.clear()
    return lps, n_tok
