"""The memory-relevant events of one tree's replay, in the engine's order, with the shape of each forward.

The ledger predicts bytes by walking these events; calibration pairs them with what the tracker measured
while the engine ran. Both read them from here, so a shape means the same thing in both places. The walk
follows the engine exactly: the scoring pass (`scoring_schedule`), the retention plan's recomputes, kept
graphs' first forwards, and the replay schedule (`build_schedule`). Event labels are the tracker marks the
engine sets (`TreeReplay._mark`).

A `Shape` is in tokens: `rows` sibling units padded to `width` input tokens, run against `past` tokens of
resident KV assembled from `pieces` units; `targets` predicted tokens; `stored` tokens of new KV kept;
in `exact` steps, whether a <KV, G> term is present, the tokens of leaf copies of the path that receive a
gradient, and the tokens of new G accumulators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from treetrain.loss.loss_config import LossConfig
from treetrain.memory.persistent import unit_resident_bytes
from treetrain.memory.retention import ResidentUse, Retention, plan_retention, tree_uses
from treetrain.replay.batch import ReplayConfig, TreeWork
from treetrain.replay.protocols import KeepGraph
from treetrain.replay.schedule import Contract, ReplayStep, active_units, build_schedule
from treetrain.replay.scoring import ScoreBatch, ScoreEvent, reference_need, scoring_schedule
from treetrain.replay.units import Unit, UnitTree
from treetrain.tree.trajectory_tree import ROOT

EventKind = Literal["score", "reference", "recompute", "restore", "keep", "step"]


@dataclass(frozen=True)
class Shape:
    """Token counts that determine one forward's memory (see module docstring)."""

    rows: int
    width: int
    past: int
    pieces: int
    targets: int
    stored: int = 0
    kv_grad: bool = False
    path_tokens: int = 0
    new_grad_tokens: int = 0


@dataclass(frozen=True)
class MemEvent:
    """One forward of the replay (with graph for `keep` and `step`, without for the rest)."""

    label: str
    """The tracker mark the engine sets before it."""
    kind: EventKind
    shape: Shape
    use: int
    """Index of the retention use it belongs to."""
    units: tuple[int, ...]
    """Units forwarded (the recomputed or kept unit, or the batch)."""
    kept: tuple[int, ...] = ()
    """Kept graphs whose backward this step runs."""
    tokens: int = 0
    """Tokens actually forwarded (unpadded), as the engine's report counts them."""


def _past(units: UnitTree, parent: int, overlap: bool) -> tuple[int, int]:
    """(past tokens, pieces) a forward under `parent` runs against."""
    if parent == ROOT:
        return 0, 0
    path = units.path(parent)
    tokens = sum(len(units[u]) for u in path)
    return (tokens - 1 if overlap else tokens), len(path)


def forward_shape(units: UnitTree, parent: int, batch: Sequence[Unit], *, stored: int = 0) -> Shape:
    past, pieces = _past(units, parent, overlap=True)
    return Shape(
        rows=len(batch),
        width=max(len(u.input_tokens) for u in batch),
        past=past,
        pieces=pieces,
        targets=sum(u.targets.num_targets for u in batch),
        stored=stored,
    )


def recompute_shape(units: UnitTree, unit: int) -> Shape:
    u = units[unit]
    past, pieces = _past(units, u.parent if u.parent is not None else ROOT, overlap=False)
    return Shape(rows=1, width=len(u), past=past, pieces=pieces, targets=0, stored=len(u))


def tree_events(
    units: UnitTree,
    uses: Sequence[ResidentUse],
    plan: Retention,
    *,
    contract: Contract,
    kept_graphs: frozenset[int] = frozenset(),
    host_tier: bool = False,
    label_prefix: str = "",
    fused_reference: bool = False,
) -> tuple[MemEvent, ...]:
    """Every forward of one tree in execution order (a separate reference walk is added by the ledger).

    With `host_tier`, a unit computed before and evicted since is copied back ('restore'), not recomputed.
    With `fused_reference`, each scoring batch is followed by the reference's forward of all its units.
    """
    events: list[MemEvent] = []
    exact = contract == "exact"
    kept_done: set[int] = set()
    seen: set[int] = set()
    step_index = 0
    for i, use in enumerate(uses):
        for u in plan.compute[i]:
            if host_tier and u in seen:
                shape = Shape(rows=0, width=0, past=0, pieces=0, targets=0)
                events.append(MemEvent(f"{label_prefix}restore {u}", "restore", shape, i, (u,)))
            elif u in kept_graphs and u not in kept_done:
                kept_done.add(u)
                parent = units[u].parent
                shape = forward_shape(units, parent if parent is not None else ROOT, [units[u]])
                tokens = len(units[u].input_tokens)
                events.append(MemEvent(f"{label_prefix}keep {u}", "keep", shape, i, (u,), tokens=tokens))
            else:
                shape = recompute_shape(units, u)
                events.append(
                    MemEvent(
                        f"{label_prefix}recompute {u}", "recompute", shape, i, (u,), tokens=len(units[u])
                    )
                )
        seen.update(plan.compute[i])
        seen.update(use.store)
        ev = use.event
        if isinstance(ev, ScoreBatch):
            members = [units[c] for c in ev.units if c not in kept_graphs]
            if members:
                stored = sum(len(c) for c in members if c.children)
                shape = forward_shape(units, ev.parent, members, stored=stored)
                label = f"{label_prefix}score {ev.parent}:{ev.units[0]}"
                tokens = sum(len(c.input_tokens) for c in members)
                events.append(
                    MemEvent(label, "score", shape, i, tuple(c.index for c in members), tokens=tokens)
                )
            if fused_reference:
                events.append(_reference_event(units, ev, i))
        elif isinstance(ev, ReplayStep):
            fresh = [units[u] for u in ev.units if u not in kept_graphs]
            kept = tuple(u for u in ev.units if u in kept_graphs)
            if fresh:
                base = forward_shape(units, ev.parent, fresh)
            else:
                base = Shape(rows=0, width=0, past=0, pieces=0, targets=0)
            path_tokens = sum(len(units[u]) for u in units.path(ev.parent)) if exact else 0
            shape = Shape(
                rows=base.rows,
                width=base.width,
                past=base.past,
                pieces=base.pieces,
                targets=base.targets,
                kv_grad=exact and any(u.children for u in fresh),
                path_tokens=path_tokens,
                new_grad_tokens=sum(len(units[u]) for u in use.new_grads),
            )
            tokens = sum(len(u.input_tokens) for u in fresh)
            events.append(
                MemEvent(f"{label_prefix}step {step_index}", "step", shape, i, ev.units, kept, tokens)
            )
            step_index += 1
    return tuple(events)


def _reference_event(units: UnitTree, ev: ScoreBatch, use: int) -> MemEvent:
    """The reference's no-grad forward of a scoring batch (all its units), in its own walk or the fused one."""
    batch = [units[c] for c in ev.units]
    shape = forward_shape(units, ev.parent, batch, stored=sum(len(c) for c in batch if c.children))
    tokens = sum(len(c.input_tokens) for c in batch)
    return MemEvent(f"reference {ev.parent}:{ev.units[0]}", "reference", shape, use, ev.units, tokens=tokens)


@dataclass(frozen=True)
class TreeLayout:
    """Everything the engine will do with one tree, derived exactly as `TreeReplay` derives it."""

    units: UnitTree
    steps: tuple[ReplayStep, ...]
    uses: tuple[ResidentUse, ...]
    retention: Retention
    events: tuple[MemEvent, ...]
    kept: frozenset[int]
    reference_events: tuple[MemEvent, ...]
    """The separate reference walk's scoring batches (empty without a KL term, or when it is fused)."""
    reference_schedule: tuple[ScoreEvent, ...]
    """The separate reference walk's events, releases included."""
    kv_bytes: tuple[int, ...]
    """Resident bytes of each unit: KV and recurrent state."""
    fused_reference: bool = False
    """The reference is scored in the scoring walk ('reference' events among `events`)."""


def plan_tree(
    work: TreeWork,
    replay: ReplayConfig,
    loss: LossConfig,
    *,
    kv_bytes_per_token: int,
    state_bytes_per_unit: int = 0,
    budget: int | None = None,
    keep_graph: KeepGraph | None = None,
    host_tier: bool = False,
    fused_reference: bool = False,
) -> TreeLayout:
    """The schedule, retention plan and forward events of one tree (see `TreeReplay._tree`).

    `fused_reference` (`treetrain.replay.tree_replay.fused_reference`): the reference is scored in the scoring
    walk, its KV counted in the retention plan; otherwise, with KL, in a walk of its own."""
    units = UnitTree.build(work.tree, work.targets, replay.chunk_size)
    skip = replay.skip_inert and loss.zero_advantage_is_inert
    steps = build_schedule(
        units, contract=replay.contract, microbatch=replay.microbatch, order=replay.order, seed=replay.seed,
        skip_inert=skip,
    )  # fmt: skip
    active = active_units(units, replay.contract, skip)
    needs_kv = [False] * len(units)
    for s in steps:
        for u in units.path(s.parent):
            needs_kv[u] = True
    kept: frozenset[int] = frozenset()
    if keep_graph is not None and replay.contract == "exact":
        kept = frozenset(
            u for u in keep_graph(units) if 0 < u < len(units) and units[u].children and active[u]
        )
    scored = [u.targets.num_targets > 0 or needs_kv[u.index] for u in units.units]
    score_events = (
        scoring_schedule(units, scored, replay.score_microbatch) if loss.ratio_source == "scoring" else ()
    )
    fused = fused_reference and bool(score_events)
    uses = tree_uses(
        units, score_events, steps, contract=replay.contract, keep=needs_kv, kept_graphs=kept,
        fused_reference=fused,
    )  # fmt: skip
    kv = tuple(unit_resident_bytes(len(u), kv_bytes_per_token, state_bytes_per_unit) for u in units.units)
    retention = plan_retention(uses, kv, budget)
    events = tree_events(
        units, uses, retention, contract=replay.contract, kept_graphs=kept, host_tier=host_tier,
        fused_reference=fused,
    )  # fmt: skip
    separate = loss.needs_reference and not fused
    ref_schedule = scoring_schedule(units, reference_need(units), replay.score_microbatch) if separate else ()
    reference = tuple(_reference_event(units, ev, -1) for ev in ref_schedule if isinstance(ev, ScoreBatch))
    return TreeLayout(units, steps, uses, retention, events, kept, reference, ref_schedule, kv, fused)


def with_resident_bytes(
    tp: TreeLayout, kv: tuple[int, ...], budget: int | None, *, contract: Contract, host_tier: bool = False
) -> TreeLayout:
    """`tp` with other resident bytes per unit (one rank's share in a context group,
    `treetrain.memory.context_cost`): the retention and its events redone over them under `budget`."""
    retention = plan_retention(tp.uses, kv, budget)
    events = tree_events(
        tp.units, tp.uses, retention, contract=contract, kept_graphs=tp.kept, host_tier=host_tier,
        fused_reference=tp.fused_reference,
    )  # fmt: skip
    return replace(tp, retention=retention, events=events, kv_bytes=kv)
