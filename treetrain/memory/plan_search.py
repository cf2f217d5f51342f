"""The planner's search: pricing candidate configurations of each mode by their ledgers.

Tree mode: for each chunk size (none first, then halving), K from all siblings down, unbounded retention
first; if nothing fits, the largest retention budget that fits (bisection between the minimum and the
unbounded resident peak); then, in `exact` mode, as many kept graphs as fit (longest units first, by
bisection on their number). The cheapest fitting candidate in tokens wins, then fewer steps, then the
lower peak. Flat mode: the largest microbatch that fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from transformers import PreTrainedModel

from treetrain.loss.loss_config import LossConfig
from treetrain.memory.events import plan_tree
from treetrain.memory.flat_cost import predict_flat
from treetrain.memory.ledger import Ledger, Residency, predict_ledger
from treetrain.memory.overrides import KeepChoice
from treetrain.memory.persistent import PersistentBytes, kv_bytes_per_token, state_bytes_per_unit
from treetrain.memory.retention import BudgetTooSmallError
from treetrain.models.lora import Reference
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.flat_reference import FlatReference
from treetrain.replay.protocols import KeepGraph
from treetrain.replay.schedule import Contract


@dataclass(frozen=True)
class Candidate:
    """One priced configuration of tree mode."""

    ledger: Ledger
    microbatch: int
    chunk: int | None
    retention: int | None
    keep: frozenset[tuple[str, int]]

    @property
    def key(self) -> tuple[int, int, int]:
        """Cheapest first, then fewer steps, then the lower peak."""
        return (self.ledger.token_cost, self.ledger.steps, self.ledger.peak.total)


class TreeSearch:
    """Prices tree-mode candidates by their ledgers (the memory model is calibrated once, then cached)."""

    def __init__(
        self,
        batch: UpdateBatch,
        model: PreTrainedModel,
        loss: LossConfig,
        base: ReplayConfig,
        budget: int,
        persistent: PersistentBytes | None,
        ref_model: Reference | None,
    ) -> None:
        self.batch, self.model, self.loss, self.base, self.budget = batch, model, loss, base, budget
        self.persistent, self.ref_model = persistent, ref_model
        self.per_token = kv_bytes_per_token(model)
        self.per_unit = state_bytes_per_unit(model)
        self.smallest: Candidate | None = None
        """The candidate with the lowest peak seen, fitting or not (for refusals)."""

    def price(
        self,
        k: int,
        chunk: int | None,
        retention: int | None,
        keep: frozenset[tuple[str, int]] = frozenset(),
        strict: bool = False,
    ) -> Candidate | None:
        """The candidate's ledger, or None when `retention` is below its minimum (raised if `strict`)."""
        cfg = replace(self.base, microbatch=k, chunk_size=chunk)
        try:
            ledger = predict_ledger(
                self.batch, self.model, cfg, self.loss, residency=Residency(retention, keep_graph=keep_fn(keep)),
                ref_model=self.ref_model, persistent=self.persistent,
            )  # fmt: skip
        except BudgetTooSmallError:
            if strict:
                raise
            return None
        cand = Candidate(ledger, k, chunk, retention, keep)
        if self.smallest is None or ledger.peak.total < self.smallest.ledger.peak.total:
            self.smallest = cand
        return cand

    def fits(self, cand: Candidate | None) -> bool:
        return cand is not None and cand.ledger.peak.total <= self.budget

    def bounded(self, k: int, chunk: int | None) -> Candidate | None:
        """The largest retention budget at which (k, chunk) fits (fewest recomputes), by bisection."""
        top = self.price(k, chunk, None)
        if top is None:
            return None
        lo, hi = top.ledger.minimum_budget, _resident_peak(top.ledger)
        best = self.price(k, chunk, lo)
        if best is None or not self.fits(best):
            return None
        for _ in range(8):
            if hi - lo <= max(1, hi // 64):
                break
            mid = (lo + hi) // 2
            cand = self.price(k, chunk, mid)
            if self.fits(cand):
                best, lo = cand, mid
            else:
                hi = mid
        return best

    def internal(self, chunk: int | None) -> list[tuple[str, int]]:
        """Internal units of every tree, the longest first (keeping their graph saves the most)."""
        cfg = replace(self.base, chunk_size=chunk)
        found: list[tuple[int, str, int]] = []
        for work in self.batch.work:
            units = plan_tree(
                work, cfg, self.loss, kv_bytes_per_token=self.per_token, state_bytes_per_unit=self.per_unit
            ).units
            found += [(len(u.input_tokens), work.tree.id, u.index) for u in units.units[1:] if u.children]
        return [(t, u) for _, t, u in sorted(found, key=lambda x: (-x[0], x[1], x[2]))]


def _resident_peak(ledger: Ledger) -> int:
    return max((r.bytes.prompt_group for r in ledger.rows), default=0)


def keep_fn(keep: frozenset[tuple[str, int]]) -> KeepGraph | None:
    """The engine's `keep_graph` for a set of (tree id, unit index)."""
    if not keep:
        return None
    return lambda units: frozenset(u for t, u in keep if t == units.tree.id)


def k_candidates(batch: UpdateBatch) -> list[int]:
    """K candidates, largest first: every sibling at once, then halving."""
    widest = max((len(n.children) for w in batch.work for n in w.tree.nodes), default=1)
    ks, k = [0], 1
    while k < widest:
        ks.append(k)
        k *= 2
    return [ks[0], *sorted(ks[1:], reverse=True)]


def chunk_candidates(batch: UpdateBatch, context: int = 1) -> list[int | None]:
    """Chunk candidates: none, then halving the longest node down to 16 tokens. In a context group of
    `context` ranks the chunk is also the ownership block, so the candidates are the ones that cut the longest
    node into 2 x context x 2^m blocks (zigzag: each rank holds 1/context of it), down to 16 tokens."""
    longest = max((len(n) for w in batch.work for n in w.tree.nodes), default=0)
    if context > 1:
        sizes = [max(1, -(-longest // (2 * context)))]
        while sizes[-1] // 2 >= 16:
            sizes.append(-(-sizes[-1] // 2))
        return list(dict.fromkeys(sizes))
    out: list[int | None] = [None]
    c = 1 << max(0, (longest - 1).bit_length() - 1)
    while c >= 16:
        out.append(c)
        c //= 2
    return out


def search_tree(
    s: TreeSearch,
    contract: Contract,
    ks: Sequence[int],
    chunks: Sequence[int | None],
    retention: int | Literal["unbounded"] | None,
    keep_graphs: KeepChoice | None,
) -> Candidate | None:
    """The best fitting tree candidate (see module docstring), or None. A forced `retention` below every
    candidate's minimum raises `BudgetTooSmallError`."""
    best: Candidate | None = None
    refused: list[BudgetTooSmallError] = []
    for chunk in chunks:
        if retention is not None:
            fixed = None if retention == "unbounded" else retention
            priced = []
            for k in ks:
                try:
                    priced.append(s.price(k, chunk, fixed, strict=True))
                except BudgetTooSmallError as e:
                    refused.append(e)
            found = [c for c in priced if c is not None and s.fits(c)]
        else:
            first = next(
                (c for c in (s.price(k, chunk, None) for k in ks) if c is not None and s.fits(c)), None
            )
            found = (
                [first]
                if first is not None
                else [c for c in (s.bounded(k, chunk) for k in ks) if c is not None]
            )
        if found:
            best = min(found, key=lambda c: c.key)
            break
    if best is None:
        if refused and s.smallest is None:  # a forced retention below every candidate's minimum
            raise min(refused, key=lambda e: e.minimum)
        return None
    if contract != "exact" or keep_graphs == "none":
        return best
    units = s.internal(best.chunk)
    if not units:
        return best
    if keep_graphs == "all":
        return s.price(best.microbatch, best.chunk, best.retention, frozenset(units)) or best
    lo, hi = 0, len(units)  # greedy: the longest units first, as many as fit
    kept = best
    while lo < hi:
        mid = (lo + hi + 1) // 2
        cand = s.price(best.microbatch, best.chunk, best.retention, frozenset(units[:mid]))
        if s.fits(cand) and cand is not None and cand.key < kept.key:
            kept, lo = cand, mid
        else:
            hi = mid - 1
    return kept


def search_flat(
    batch: UpdateBatch, model: PreTrainedModel, loss: LossConfig, budget: int, microbatch: int | None,
    persistent: PersistentBytes | None, ref_model: Reference | None, max_logit_elements: int,
) -> tuple[int, Ledger, int]:  # fmt: skip
    """(microbatch, ledger, token cost): the largest microbatch that fits, else the smallest peak."""
    calls = sum(len(w.tree.records[t].calls) for w in batch.work for t in w.trajectories)
    mbs = [microbatch] if microbatch else sorted({1, *_powers(calls + 1)}, reverse=True)
    found = []
    sizes = FlatReference(model, loss, ref_model=ref_model).call_sizes(batch)
    for mb in mbs:
        ledger, cost = predict_flat(
            batch, model, loss, microbatch=max(1, mb), ref_model=ref_model, persistent=persistent,
            max_logit_elements=max_logit_elements, sizes=sizes,
        )  # fmt: skip
        found.append((max(1, mb), ledger, cost))
        if ledger.peak.total <= budget:
            return found[-1]
    return min(found, key=lambda f: f[1].peak.total)


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k < limit:
        out.append(k)
        k *= 2
    return out
