"""The scoring pass: every unit evaluated once, without a graph, against resident ancestor KV.

It yields the current policy's logprob of every target (PPO's "old" logprobs), or the reference model's,
and leaves behind the resident KV that replay will read. Units are visited in pre-order, siblings batched;
a unit's KV is kept only while something still needs it (`keep`), otherwise released as soon as its
subtree is done.

`PathKV` is the one place that assembles a unit's ancestor KV, recomputing whatever is not resident (evicted
under a retention budget, or never scored) from the nearest resident ancestor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from treetrain.engine.pieces import forward_units, gather_targets, own_kv, target_stats
from treetrain.engine.resident import ResidentIdentity, ResidentKey, ResidentStore
from treetrain.engine.units import UnitTree
from treetrain.models.decoder import LayerKV, concat_past
from treetrain.tree.model import ROOT


class PathKV:
    """Resident KV of units of one tree, recomputed on demand."""

    def __init__(
        self,
        model: PreTrainedModel,
        units: UnitTree,
        store: ResidentStore,
        identity: ResidentIdentity,
        device: torch.device,
        on_recompute: Callable[[int, int], None] | None = None,
    ) -> None:
        self.model = model
        self.units = units
        self.store = store
        self.identity = identity
        self.device = device
        self.on_recompute = on_recompute
        self.recomputed_units = 0
        self.recomputed_tokens = 0

    def key(self, unit: int) -> ResidentKey:
        u = self.units[unit]
        return ResidentKey(self.units.tree.id, unit, self.units.tree.nodes[u.node].id)

    def resident(self, unit: int) -> bool:
        return self.store.has_kv(self.key(unit), self.identity)

    def pieces(self, unit: int) -> list[list[LayerKV]]:
        """KV of every unit on the path to `unit` (inclusive), root side first; recomputes missing ones."""
        path = self.units.path(unit)
        missing = [u for u in path if not self.resident(u)]
        for u in missing:  # root side first, so each recompute finds its ancestors resident
            self._recompute(u)
        return [self.store.get(self.key(u), self.identity) for u in path]

    @torch.no_grad()
    def _recompute(self, unit: int) -> None:
        parent = self.units[unit].parent
        past = None
        if parent is not None and parent != ROOT:
            past = concat_past([self.store.get(self.key(u), self.identity) for u in self.units.path(parent)])
        _, out = forward_units(self.model, [self.units[unit]], past, self.device, overlap=False)
        self.store.put(self.key(unit), list(zip(out.keys, out.values)), self.identity)
        self.recomputed_units += 1
        self.recomputed_tokens += len(self.units[unit])
        if self.on_recompute is not None:
            self.on_recompute(unit, len(self.units[unit]))

    def past_for_children(self, unit: int) -> list[LayerKV] | None:
        """The past that `unit`'s children run against (None under the empty root)."""
        if unit == ROOT:
            return None
        return past_before_overlap(self.pieces(unit))


def past_before_overlap(pieces: Sequence[Sequence[LayerKV]]) -> list[LayerKV] | None:
    """Concatenate path pieces, leaving out the last position: the children recompute it as their overlap."""
    if not pieces:
        return None
    last = [(k[:, :, :-1], v[:, :, :-1]) for k, v in pieces[-1]]
    return concat_past([*pieces[:-1], last])


@torch.no_grad()
def scoring_pass(
    model: PreTrainedModel,
    paths: PathKV,
    *,
    microbatch: int,
    need: Sequence[bool],
    keep: Callable[[int], bool],
    with_entropy: bool = False,
    max_logit_elements: int,
) -> tuple[list[torch.Tensor | None], int]:
    """Logprobs of every needed unit's targets, `[M_u]` per unit (None where not needed).

    `need[u]` says the unit must be evaluated (it has targets, or descendants that do). Internal units' KV
    is stored; `keep(u)` says whether it stays after u's subtree is scored. Returns the logprobs and the
    number of tokens evaluated.
    """
    units = paths.units
    logps: list[torch.Tensor | None] = [None] * len(units)
    tokens = 0
    stack: list[tuple[int, bool]] = [(ROOT, False)]
    while stack:
        u, done = stack.pop()
        if done:
            if u != ROOT and not keep(u):
                paths.store.release(paths.key(u))
            continue
        kids = [c for c in units[u].children if need[c]]
        k = microbatch or max(1, len(kids))
        for i in range(0, len(kids), k):
            batch = [units[c] for c in kids[i : i + k]]
            batch_ids, out = forward_units(model, batch, paths.past_for_children(u), paths.device)
            tokens += sum(batch_ids.lengths)
            gathered = gather_targets([b.targets for b in batch], batch_ids.input_ids.shape[1], paths.device)
            lp, _ = target_stats(
                model, out.hidden, gathered, with_entropy=with_entropy, max_logit_elements=max_logit_elements
            )
            for row, unit in enumerate(batch):
                a, b = gathered.target_offsets[row], gathered.target_offsets[row + 1]
                logps[unit.index] = lp[a:b].detach()
                if unit.children:
                    kv = [(k.clone(), v.clone()) for k, v in own_kv(unit, out, row)]
                    paths.store.put(paths.key(unit.index), kv, paths.identity)
        stack.append((u, True))
        for c in reversed(kids):
            if units[c].children:
                stack.append((c, False))
    return logps, tokens
