"""The scoring pass: every unit evaluated once, without a graph, against resident ancestor KV.

It yields the current policy's logprob of every target (PPO's "old" logprobs), or the reference model's,
and leaves behind the resident KV that replay will read. Units are visited in pre-order, siblings batched;
a unit's KV is kept only while something still needs it (`keep`), otherwise released as soon as its
subtree is done.

`PathKV` is the one place that assembles a unit's ancestor KV, recomputing whatever is not resident (evicted
under a retention budget, or never scored) from the nearest resident ancestor, or copying it back when it
was offloaded to host memory.

With a `ReferenceWalk` the same walk also scores the reference (the policy with its adapters off): at every
batch the policy's forward runs, then the reference's on the same tokens against its own store, whose
identity says adapters 'off'. The reference store holds only the current path and is emptied as each
subtree is done, so the KL term costs no second walk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import PreTrainedModel

from treetrain.models.context_exchange import ContextExchange
from treetrain.models.decoder import LayerEntry, SharedPast
from treetrain.models.layer_entry import map_entry
from treetrain.models.lora import adapter_state, unwrap
from treetrain.models.recurrent_state import continues_with_overlap, unkeyed_layers
from treetrain.replay.context_replay import ContextShards
from treetrain.replay.pieces import forward_units, gather_targets, own_kv, target_stats
from treetrain.replay.resident import (
    ResidentIdentity,
    ResidentKey,
    ResidentStore,
    StaleResidentStateError,
)
from treetrain.replay.units import Unit, UnitTree
from treetrain.tree.trajectory_tree import ROOT


class PathKV:
    """Resident KV of units of one tree, recomputed on demand."""

    def __init__(
        self,
        model: PreTrainedModel,
        units: UnitTree,
        store: ResidentStore,
        identity: ResidentIdentity,
        device: torch.device,
        produce: Callable[[int], bool] | None = None,
        shards: ContextShards | None = None,
    ) -> None:
        self.model = model
        self.units = units
        self.store = store
        self.identity = identity
        self.device = device
        self.produce = produce
        """Called for a missing unit before recomputing it; returns True if it produced the KV itself
        (the engine's kept-graph forward does: a kept unit's KV comes from its graph forward)."""
        self.recomputed_units = 0
        self.recomputed_tokens = 0
        self.restored_units = 0
        self.recurrent = unkeyed_layers(unwrap(model))
        """Layers whose resident state is not KV: recurrent (taken before a unit's last token) or none."""
        self.overlap = continues_with_overlap(unwrap(model))
        """A recompute feeds the parent's last token again, as every child unit runs (hybrid layers too)."""
        self.shards = shards
        """With a context group, this rank keeps the KV of the units it owns only (`context_replay`)."""

    @property
    def exchange(self) -> ContextExchange | None:
        return None if self.shards is None else self.shards.exchange

    def put(self, unit: int, kv: Sequence[LayerEntry]) -> None:
        """Store `unit`'s resident state: with a context group, what this rank keeps of it."""
        if self.shards is not None:
            kv = self.shards.kept(kv, self.units[unit].offset, self.recurrent)
        self.store.put(self.key(unit), kv, self.identity)

    def key(self, unit: int) -> ResidentKey:
        u = self.units[unit]
        return ResidentKey(self.units.tree.id, unit, self.units.tree.nodes[u.node].id)

    def resident(self, unit: int) -> bool:
        return self.store.has_kv(self.key(unit), self.identity)

    def pieces(self, unit: int) -> list[list[LayerEntry]]:
        """KV of every unit on the path to `unit` (inclusive), root side first; recomputes missing ones."""
        path = self.units.path(unit)
        missing = [u for u in path if not self.resident(u)]
        for u in missing:  # root side first, so each recompute finds its ancestors resident
            if self.store.has_host(self.key(u)):
                self.store.restore(self.key(u), self.identity, self.device)
                self.restored_units += 1
            elif self.produce is None or not self.produce(u):
                self._recompute(u)
        return [self.store.get(self.key(u), self.identity) for u in path]

    @torch.no_grad()
    def _recompute(self, unit: int) -> None:
        """The unit's state from its parent's path. Recurrent state is taken before the parent's last token,
        so a model with recurrent layers recomputes with the overlap, as its children run."""
        parent = self.units[unit].parent
        pieces = []
        if parent is not None and parent != ROOT:
            pieces = [self.store.get(self.key(u), self.identity) for u in self.units.path(parent)]
        overlap = self.overlap
        if overlap:
            past = past_before_overlap(pieces, recurrent=self.recurrent, exchange=self.exchange)
        else:
            past = SharedPast.of(pieces, exchange=self.exchange) if pieces else None
        _, out = forward_units(self.model, [self.units[unit]], past, self.device, overlap=overlap)
        # Clone: the new KV is a view into a cache that also holds the whole past.
        kv = [map_entry(torch.Tensor.clone, e) for e in own_kv(self.units[unit], out, 0, overlap=overlap)]
        del out
        self.put(unit, kv)
        self.recomputed_units += 1
        self.recomputed_tokens += len(self.units[unit])

    def past_for_children(self, unit: int) -> SharedPast | None:
        """The past that `unit`'s children run against (None under the empty root)."""
        if unit == ROOT:
            return None
        return past_before_overlap(self.pieces(unit), recurrent=self.recurrent, exchange=self.exchange)


def past_before_overlap(
    pieces: Sequence[Sequence[LayerEntry]],
    grads: Sequence[Sequence[LayerEntry] | None] | None = None,
    *,
    recurrent: frozenset[int] = frozenset(),
    exchange: ContextExchange | None = None,
) -> SharedPast | None:
    """The path pieces as one shared past (never concatenated), leaving out the last position: the children
    recompute it as their overlap. `grads` are the pieces' G accumulators (`exact` replay); layers in
    `recurrent` hold state taken before that position already; `exchange` is the context group's, whose
    other ranks hold the pieces whose KV is on the `meta` device here."""
    if not pieces:
        return None
    return SharedPast.of(pieces, grads, recurrent=recurrent, exchange=exchange).without_last_position()


def reference_need(units: UnitTree) -> list[bool]:
    """Units the reference scoring pass evaluates: those with targets and their ancestors."""
    need = [u.targets.num_targets > 0 for u in units.units]
    for u in reversed(units.units):  # children have larger indices than parents
        if need[u.index] and u.parent is not None:
            need[u.parent] = True
    return need


@dataclass(frozen=True)
class ScoreBatch:
    """Score `units` (siblings, children of `parent`) in one no-grad forward against `parent`'s path."""

    parent: int
    units: tuple[int, ...]


@dataclass(frozen=True)
class ScoreDone:
    """`unit`'s subtree is scored: its KV is released here unless something later still needs it."""

    unit: int


ScoreEvent = ScoreBatch | ScoreDone


def scoring_schedule(units: UnitTree, need: Sequence[bool], microbatch: int) -> tuple[ScoreEvent, ...]:
    """The scoring pass's events in execution order: pre-order, siblings batched by `microbatch` (0 = all).

    It is data for the same reason as the replay schedule: the ledger and the retention policy walk it.
    """
    events: list[ScoreEvent] = []
    stack: list[tuple[int, bool]] = [(ROOT, False)]
    while stack:
        u, done = stack.pop()
        if done:
            if u != ROOT:
                events.append(ScoreDone(u))
            continue
        kids = [c for c in units[u].children if need[c]]
        k = microbatch or max(1, len(kids))
        for i in range(0, len(kids), k):
            events.append(ScoreBatch(u, tuple(kids[i : i + k])))
        stack.append((u, True))
        for c in reversed(kids):
            if units[c].children:
                stack.append((c, False))
    return tuple(events)


@dataclass
class ReferenceWalk:
    """The reference scored in the policy's walk: `paths` over its own store and identity, run inside
    `enter()` (e.g. the adapters switched off). `logps` and `tokens` fill as the walk goes."""

    paths: PathKV
    enter: Callable[[], contextlib.AbstractContextManager[object]]
    before_batch: Callable[[ScoreBatch], None] | None = None
    logps: list[torch.Tensor | None] = field(default_factory=list)
    tokens: int = 0


@dataclass(frozen=True)
class LogitSettings:
    """How a scoring forward turns hidden states into logprobs: in pieces of at most `max_elements` logits
    (the `[rows, T, V]` buffer stays bounded whatever the vocabulary), each divided by `temperature` first
    (the sampling temperature, so the scored policy is the one that sampled)."""

    max_elements: int
    temperature: float = 1.0


@torch.no_grad()
def scoring_pass(
    paths: PathKV,
    *,
    microbatch: int,
    need: Sequence[bool],
    keep: Callable[[int], bool],
    logits: LogitSettings,
    with_entropy: bool = False,
    before_batch: Callable[[ScoreBatch], None] | None = None,
    forward_elsewhere: Callable[[int], bool] | None = None,
    reference: ReferenceWalk | None = None,
) -> tuple[list[torch.Tensor | None], int]:
    """Logprobs of every needed unit's targets, `[M_u]` per unit (None where not needed), forwarded through
    `paths.model`, the model whose KV `paths` keeps (so the two cannot disagree).

    `need[u]` says the unit must be evaluated (it has targets, or descendants that do). Internal units' KV
    is stored; `keep(u)` says whether it stays after u's subtree is scored. `before_batch` is called before
    each batch (the retention policy and the memory tracker listen). Units for which `forward_elsewhere(u)`
    is true are left out of the no-grad forwards (their first forward keeps a graph; see `TreeReplay`).
    With `reference`, every batch is also scored by the reference, all its units included (see the module
    docstring); its logprobs and tokens are left in `reference`. Both turn logits into logprobs as `logits`
    says (bounded pieces, at the loss's `logit_temperature`).
    Returns the logprobs and the number of tokens evaluated.
    """
    units = paths.units
    logps: list[torch.Tensor | None] = [None] * len(units)
    tokens = 0
    if reference is not None:
        reference.logps = [None] * len(units)
    for event in scoring_schedule(units, need, microbatch):
        if isinstance(event, ScoreDone):
            if not keep(event.unit):
                paths.store.release(paths.key(event.unit))
            if reference is not None:
                reference.paths.store.release(reference.paths.key(event.unit))
            continue
        if before_batch is not None:
            before_batch(event)
        members = [c for c in event.units if forward_elsewhere is None or not forward_elsewhere(c)]
        if members:
            score = partial(
                _score_batch, paths.model, paths, event.parent, logps=logps, with_entropy=with_entropy,
                logits=logits,
            )  # fmt: skip
            tokens += _score_splitting(score, [units[c] for c in members])
        elif event.parent != ROOT:  # the path is still made resident, as the retention plan expects
            paths.pieces(event.parent)
        if reference is not None:
            if reference.before_batch is not None:
                reference.before_batch(event)
            with reference.enter():
                score = partial(
                    _score_batch, reference.paths.model, reference.paths, event.parent, logps=reference.logps,
                    with_entropy=False, logits=logits,
                )  # fmt: skip
                reference.tokens += _score_splitting(score, [units[c] for c in event.units])
    return logps, tokens


def _score_splitting(score: Callable[[Sequence[Unit]], int], batch: Sequence[Unit]) -> int:
    """`score(batch)` (one `_score_batch`), split in halves on out-of-memory. Safe to retry: a scoring
    forward has no graph and its only side effects (logprobs, stored KV) are overwritten by the retry."""
    try:
        return score(batch)
    except torch.OutOfMemoryError:
        if len(batch) == 1:
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = len(batch) // 2
        return sum(_score_splitting(score, part) for part in (batch[:half], batch[half:]))


def _score_batch(
    model: PreTrainedModel,
    paths: PathKV,
    parent: int,
    batch: Sequence[Unit],
    logps: list[torch.Tensor | None],
    with_entropy: bool,
    logits: LogitSettings,
) -> int:
    """One scoring forward; its activations die on return, before the next batch runs."""
    state = adapter_state(model)
    if state != paths.identity.adapters:  # e.g. a reference forward run with the adapters left on
        raise StaleResidentStateError(
            f"scoring with adapters {state!r} into a store of identity adapters={paths.identity.adapters!r}"
        )
    batch_ids, out = forward_units(model, batch, paths.past_for_children(parent), paths.device)
    gathered = gather_targets([b.targets for b in batch], batch_ids.input_ids.shape[1], paths.device)
    lp, _ = target_stats(
        model,
        out.hidden,
        gathered,
        with_entropy=with_entropy,
        max_logit_elements=logits.max_elements,
        temperature=logits.temperature,
    )
    for row, unit in enumerate(batch):
        a, b = gathered.target_offsets[row], gathered.target_offsets[row + 1]
        logps[unit.index] = lp[a:b].detach()
        if unit.children:
            kv = [map_entry(torch.Tensor.clone, e) for e in own_kv(unit, out, row)]
            paths.put(unit.index, kv)
    return sum(batch_ids.lengths)
