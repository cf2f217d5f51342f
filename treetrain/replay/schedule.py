"""The replay schedule: which sibling units are run under autograd together, and in what order.

Post-order over units. For a unit u, the subtrees of u's children are finished first; then u's children
are replayed in batches of at most K siblings against u's resident path. A child's own replay comes after
its subtree, so in `exact` mode its KV gradient G is complete when its recompute pushes it through.

A unit is *active* when it can contribute gradient: it has loss-carrying targets (not all inert), or, in
`exact` mode, an active descendant. Inactive units are never replayed. The schedule is data, so the
ledger and the retention policy see the same future the engine will execute.

Example:
    >>> steps = build_schedule(units, contract="exact", microbatch=2, order="tree")   # doctest: +SKIP
    >>> steps[0]                                                                         # doctest: +SKIP
    ReplayStep(parent=3, units=(4, 5))
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from treetrain.replay.units import UnitTree
from treetrain.tree.trajectory_tree import ROOT

Contract = Literal["exact", "response_only"]
Order = Literal["tree", "reverse", "shuffle"]
CONTRACTS: tuple[Contract, ...] = ("exact", "response_only")
ORDERS: tuple[str, ...] = ("tree", "reverse", "shuffle")


@dataclass(frozen=True)
class ReplayStep:
    """Replay `units` (siblings, children of `parent`) in one forward and backward."""

    parent: int
    units: tuple[int, ...]


def active_units(units: UnitTree, contract: Contract, skip_inert: bool) -> tuple[bool, ...]:
    """Which units contribute gradient (see module docstring)."""
    own = [u.targets.num_targets > 0 and not (skip_inert and u.targets.is_inert()) for u in units.units]
    if contract == "response_only":
        return tuple(own)
    active = list(own)
    for u in reversed(units.units):  # children have larger indices than parents
        if active[u.index] and u.parent is not None:
            active[u.parent] = True
    return tuple(active)


def build_schedule(
    units: UnitTree,
    *,
    contract: Contract,
    microbatch: int,
    order: Order = "tree",
    seed: int = 0,
    skip_inert: bool = True,
) -> tuple[ReplayStep, ...]:
    """Steps in execution order. `microbatch` is K (0 = all siblings at once)."""
    if contract not in CONTRACTS:
        raise ValueError(f"contract must be one of {CONTRACTS}, got {contract!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if microbatch < 0:
        raise ValueError(f"microbatch (K) must be >= 0, got {microbatch}")
    active = active_units(units, contract, skip_inert)
    need_kv = list(active)
    for unit in reversed(units.units):  # a unit's KV is needed if any descendant is active
        if need_kv[unit.index] and unit.parent is not None:
            need_kv[unit.parent] = True
    rng = random.Random(seed)
    order_of: dict[int, list[int]] = {}

    def ordered(u: int) -> list[int]:
        if u not in order_of:
            kids = [c for c in units[u].children if need_kv[c]]
            if order == "reverse":
                kids.reverse()
            elif order == "shuffle":
                rng.shuffle(kids)
            order_of[u] = kids
        return order_of[u]

    steps: list[ReplayStep] = []
    # Iterative post-order: (unit, expanded?)
    stack: list[tuple[int, bool]] = [(ROOT, False)]
    while stack:
        u, expanded = stack.pop()
        kids = ordered(u)
        if not expanded:
            stack.append((u, True))
            for c in reversed(kids):
                if units[c].children:
                    stack.append((c, False))
            continue
        replay = [c for c in kids if active[c]]
        k = microbatch or max(1, len(replay))
        for i in range(0, len(replay), k):
            steps.append(ReplayStep(u, tuple(replay[i : i + k])))
    return tuple(steps)
