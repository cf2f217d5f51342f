"""Bounded retention: a byte budget for resident state, with farthest-next-use eviction and recompute.

The engine's work on one tree is a known sequence of *uses* (`tree_uses`): scoring batches, the releases
that end a scored subtree, and replay steps. Each use needs the KV of some units resident (the parent path
it runs against), may store new KV (scoring stores internal units), may create KV-gradient accumulators G
(`exact` steps), and releases what nothing will read again. Because the sequence is known in advance,
eviction can look at the future: when resident bytes would exceed the budget, the resident unit whose
next use is farthest away goes first (Belady's rule; optimal in recomputes when units are the same size).
An evicted unit is recomputed, without a graph, from its nearest resident ancestor when it is needed again
(`treetrain.replay.scoring.PathKV`), so a budget changes cost, never the gradient.

What cannot be evicted sets the *minimum* budget: at every use, the KV of the path it runs against, the
KV it stores, every live G accumulator (they hold gradient not yet pushed through, `exact` mode), the
ancestors pinned by kept graphs, and, when the reference is scored in the same walk, the reference's own
KV of the path (`ResidentUse.other`: another store's bytes, counted against the same budget). A budget below that maximum is refused (`BudgetTooSmallError`).

`plan_retention` is a pure function of the uses, so the plan the engine carries out
(`treetrain.memory.replay_layout.lay_out`) and the ledger (`treetrain.memory.ledger`) make
the same decisions.

Example:
    >>> uses = [ResidentUse("a", need=(1,)), ResidentUse("b", need=(2,)), ResidentUse("c", need=(1,))]
    >>> plan = plan_retention(uses, kv_bytes=[0, 10, 10], budget=10)
    >>> plan.evict, plan.compute, plan.minimum
    (((), (1,), (2,)), ((1,), (2,), (1,)), 10)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treetrain.bytesize import format_bytes
from treetrain.errors import TreetrainError
from treetrain.replay.schedule import Contract, ReplayStep
from treetrain.replay.scoring import ScoreBatch, ScoreDone, ScoreEvent
from treetrain.replay.units import UnitTree
from treetrain.tree.trajectory_tree import ROOT

NEVER = 1 << 62


class BudgetTooSmallError(TreetrainError, ValueError):
    """The retention budget is below the minimum this update can run in; the message names the minimum."""

    def __init__(self, budget: int, minimum: int, where: str) -> None:
        self.budget = budget
        self.minimum = minimum
        super().__init__(
            f"retention budget {budget} B ({format_bytes(budget)}) is below the minimum feasible budget "
            f"{minimum} B ({format_bytes(minimum)}), needed at {where}: the KV of the path it runs against, "
            "the KV it stores and every live KV-gradient accumulator must be resident together"
        )


@dataclass(frozen=True)
class ResidentUse:
    """One event of a tree's processing, as retention sees it."""

    label: str
    """Readable name: 'score 3' or 'step 5'."""
    need: tuple[int, ...] = ()
    """Units whose KV must be resident during the event (the parent path, root side first)."""
    store: tuple[int, ...] = ()
    """Units whose KV the event computes and keeps (a scoring batch's internal units)."""
    new_grads: tuple[int, ...] = ()
    """Units whose KV-gradient accumulator the event creates."""
    release: tuple[int, ...] = ()
    """Units forgotten after the event (KV and accumulator)."""
    pinned: tuple[int, ...] = ()
    """Units whose KV a kept graph holds during the event: not evictable."""
    event: Any = None
    """The engine's own event (`ScoreBatch`, `ScoreDone` or `ReplayStep`) this use stands for."""
    other: tuple[int, ...] = ()
    """Units whose KV the fused reference walk holds in its own store during the event (the path and what
    the batch stores): counted against the budget, never evicted by it."""


def tree_uses(
    units: UnitTree,
    score_events: Sequence[ScoreEvent],
    steps: Sequence[ReplayStep],
    *,
    contract: Contract,
    keep: Sequence[bool],
    kept_graphs: frozenset[int] = frozenset(),
    fused_reference: bool = False,
) -> tuple[ResidentUse, ...]:
    """The uses of one tree in execution order: the scoring pass (if any), then the replay steps.

    With `fused_reference`, each scoring batch also carries the reference store's KV (`other`).

    `keep[u]` is whether u's KV stays resident after its subtree is scored (the engine keeps what a step
    will read). Units in `kept_graphs` are not stored by scoring: their first forward keeps a graph and
    happens at their first use; from then until their own step their parent path is pinned.
    """
    raw: list[ResidentUse] = []
    for ev in score_events:
        if isinstance(ev, ScoreDone):
            raw.append(
                ResidentUse(f"release {ev.unit}", release=() if keep[ev.unit] else (ev.unit,), event=ev)
            )
            continue
        assert isinstance(ev, ScoreBatch)
        stored = tuple(c for c in ev.units if units[c].children and c not in kept_graphs)
        other = (
            (*units.path(ev.parent), *(c for c in ev.units if units[c].children)) if fused_reference else ()
        )
        raw.append(
            ResidentUse(f"score {len(raw)}", need=units.path(ev.parent), store=stored, event=ev, other=other)
        )
    has_grad: set[int] = set()
    for i, step in enumerate(steps):
        path = units.path(step.parent)
        new = tuple(u for u in path if u not in has_grad) if contract == "exact" else ()
        has_grad.update(new)
        raw.append(ResidentUse(f"step {i}", need=path, new_grads=new, release=step.units, event=step))
    if not kept_graphs:
        return tuple(raw)
    first = {u: next((i for i, r in enumerate(raw) if u in r.need), None) for u in kept_graphs}
    last = {u: next((i for i, r in enumerate(raw) if u in r.release), len(raw) - 1) for u in kept_graphs}
    out = []
    for i, r in enumerate(raw):
        pins: set[int] = set()
        for u, f in first.items():
            if f is not None and f <= i <= last[u]:
                parent = units[u].parent
                pins.update(units.path(parent) if parent not in (None, ROOT) else ())
        out.append(
            ResidentUse(
                r.label, r.need, r.store, r.new_grads, r.release, tuple(sorted(pins)), r.event, r.other
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class Retention:
    """What retention does at every use, and what it costs."""

    budget: int | None
    minimum: int
    """Smallest feasible budget in bytes (see the module docstring)."""
    minimum_at: str
    """The use that sets the minimum."""
    evict: tuple[tuple[int, ...], ...]
    """Per use, the units evicted just before it, in eviction order."""
    compute: tuple[tuple[int, ...], ...]
    """Per use, the units whose KV is computed without a graph before it, root side first."""
    resident: tuple[int, ...]
    """Per use, resident bytes (KV and accumulators) while it runs."""
    recomputes: int
    """Computations of KV that had been computed before (evicted, then needed again)."""

    @property
    def peak(self) -> int:
        return max(self.resident, default=0)


def plan_retention(uses: Sequence[ResidentUse], kv_bytes: Sequence[int], budget: int | None) -> Retention:
    """Decide evictions for `uses` under `budget` bytes (None = unbounded). `kv_bytes[u]` is u's KV size;
    an accumulator has the same size. Raises `BudgetTooSmallError` below the minimum."""
    next_use = _NextUse(uses)
    resident: set[int] = set()
    grads: set[int] = set()
    seen: set[int] = set()
    evict_log: list[tuple[int, ...]] = []
    compute_log: list[tuple[int, ...]] = []
    resident_log: list[int] = []
    minimum, minimum_at, recomputes = 0, "no use", 0
    for i, use in enumerate(uses):
        fixed = set(use.need) | set(use.store) | set(use.pinned)
        grad_bytes = sum(kv_bytes[u] for u in grads | set(use.new_grads))
        other = sum(kv_bytes[u] for u in use.other)
        required = sum(kv_bytes[u] for u in fixed) + grad_bytes + other
        if required > minimum:
            minimum, minimum_at = required, use.label
        evicted: list[int] = []
        if budget is not None:
            if required > budget:
                raise BudgetTooSmallError(budget, _minimum(uses, kv_bytes), use.label)
            others = sorted(resident - fixed)
            held = sum(kv_bytes[u] for u in others)
            while held + required > budget:
                victim = max(others, key=lambda u: (next_use.after(u, i), kv_bytes[u], u))
                others.remove(victim)
                resident.discard(victim)
                held -= kv_bytes[victim]
                evicted.append(victim)
        missing = tuple(u for u in (*use.need, *use.pinned) if u not in resident)
        recomputes += sum(1 for u in missing if u in seen)
        seen.update(missing)
        seen.update(use.store)
        resident.update(missing)
        resident.update(use.store)
        grads.update(use.new_grads)
        resident_log.append(sum(kv_bytes[u] for u in resident) + sum(kv_bytes[u] for u in grads) + other)
        evict_log.append(tuple(evicted))
        compute_log.append(tuple(dict.fromkeys(missing)))
        for u in use.release:
            resident.discard(u)
            grads.discard(u)
    return Retention(
        budget, minimum, minimum_at, tuple(evict_log), tuple(compute_log), tuple(resident_log), recomputes
    )


def minimum_budget(uses: Sequence[ResidentUse], kv_bytes: Sequence[int]) -> int:
    """The smallest budget `plan_retention` accepts for these uses."""
    return _minimum(uses, kv_bytes)


def _minimum(uses: Sequence[ResidentUse], kv_bytes: Sequence[int]) -> int:
    grads: set[int] = set()
    best = 0
    for use in uses:
        fixed = set(use.need) | set(use.store) | set(use.pinned)
        grad_bytes = sum(kv_bytes[u] for u in grads | set(use.new_grads))
        best = max(best, sum(kv_bytes[u] for u in fixed) + grad_bytes + sum(kv_bytes[u] for u in use.other))
        grads.update(use.new_grads)
        grads.difference_update(use.release)
    return best


class _NextUse:
    """The index of each unit's next use after a given use (`NEVER` if none)."""

    def __init__(self, uses: Sequence[ResidentUse]) -> None:
        self.at: dict[int, list[int]] = {}
        for i, use in enumerate(uses):
            for u in (*use.need, *use.pinned):
                at = self.at.setdefault(u, [])
                if not at or at[-1] != i:
                    at.append(i)

    def after(self, unit: int, i: int) -> int:
        at = self.at.get(unit, [])
        j = bisect.bisect_right(at, i)
        return at[j] if j < len(at) else NEVER
