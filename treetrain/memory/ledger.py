"""The ledger: bytes by lifetime class, predicted as a timeline over the replay's actual schedule.

`predict_ledger(batch, model, replay, loss)` walks the same events the engine will run (scoring batches,
the reference pass, recomputes, kept-graph forwards and replay steps; `treetrain.memory.events`), under
the same retention plan, and books at each event's peak moment:

- persistent: parameters, reference model, optimizer state (per ZeRO stage and world size);
- prompt-group: resident KV and live KV-gradient accumulators, per the retention plan;
- temporary: the event's own activation bytes (calibrated on the model, `treetrain.memory.calibrate`),
  kept graphs still waiting for their step, and the scored logprobs held for the tree;
- boundary: the accumulated parameter gradients (booked for the whole window).

The row with the largest total is the peak; its cause names the event and its largest class.

Example:
    >>> ledger = predict_ledger(batch, model, ReplayConfig(microbatch=2), LossConfig())   # doctest: +SKIP
    >>> print(ledger.table())                                                              # doctest: +SKIP
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from transformers import PreTrainedModel

from treetrain.bytesize import format_bytes
from treetrain.lifetime import CLASSES, ClassBytes
from treetrain.loss.loss_config import LossConfig
from treetrain.loss.manifest import Manifest
from treetrain.memory.calibrate import calibrate
from treetrain.memory.context_cost import ContextShare, QueryBytes, query_bytes
from treetrain.memory.events import MemEvent, Shape, TreeLayout, plan_tree, with_resident_bytes
from treetrain.memory.memory_model import MemoryModel
from treetrain.memory.persistent import PersistentBytes, model_persistent_bytes
from treetrain.models.lora import Reference, reference_module
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.protocols import KeepGraph
from treetrain.replay.reference import fused_reference
from treetrain.replay.scoring import ScoreBatch, ScoreDone


@dataclass(frozen=True)
class LedgerRow:
    """Predicted bytes at the peak moment of one event."""

    index: int
    tree: int
    """Index of the tree in the update batch."""
    label: str
    """The event, as the engine marks it ('score 1:2', 'step 4', 'recompute 3', ...)."""
    kind: str
    bytes: ClassBytes
    shape: Shape | None = None
    tokens: int = 0
    """Tokens the event forwards (with a graph for 'step' and 'keep', without for the rest)."""


@dataclass(frozen=True)
class RankShare:
    """One rank of a context group in a ledger: which, of how many, and the bytes it exchanges per update."""

    size: int
    """C, the ranks of the group."""
    rank: int
    """The rank whose timeline the ledger's rows are: the one with the highest peak."""
    sent_bytes: int
    """Bytes this rank sends to the rest of its group over the update (`ContextShare.sent`); each rank sends
    the same, every rank running the same steps."""
    resident_bytes: int
    """Resident KV of every unit of the update, over the whole group (what one device would hold at C = 1
    with nothing evicted): the scale `sent_bytes` is compared with."""
    rank_peaks: tuple[int, ...]
    """Each rank's predicted peak, bytes."""

    def line(self) -> str:
        ratio = self.sent_bytes / self.resident_bytes if self.resident_bytes else 0.0
        return (
            f"context group of {self.size}: per-rank peak {format_bytes(max(self.rank_peaks))} (rank {self.rank}); "
            f"each rank sends {format_bytes(self.sent_bytes)} per update, {ratio:.1%} of the update's resident "
            f"KV ({format_bytes(self.resident_bytes)})"
        )


@dataclass(frozen=True)
class Ledger:
    """A predicted memory timeline and its peak."""

    rows: tuple[LedgerRow, ...]
    peak: ClassBytes
    peak_step: int
    """Index of the peak row."""
    peak_cause: str
    persistent: PersistentBytes
    budget: int | None
    """Retention budget the timeline was planned under (None = unbounded)."""
    minimum_budget: int
    """Smallest retention budget this update can run in."""
    recomputes: int
    """KV recomputations the retention plan forces (copies back from host memory with a host tier)."""
    manifest_bytes: int
    """Host bytes of the manifest (update-boundary, not on the device)."""
    kv_bytes_per_token: int = 0
    """Resident KV of one token (attention layers that keep their own KV)."""
    state_bytes_per_unit: int = 0
    """Resident recurrent state of one unit, whatever its length: conv and recurrent state of every
    linear-attention, Mamba or Gated DeltaNet layer (0 for a model without any)."""
    context: RankShare | None = None
    """With `ReplayConfig.context_parallel` > 1: the rank of the group these rows are, and what it sends."""

    def resident_line(self) -> str:
        """What one resident unit holds, as `treetrain plan` prints it."""
        text = f"resident per unit: KV {format_bytes(self.kv_bytes_per_token)} per token"
        if self.state_bytes_per_unit:
            text += f" + recurrent state {format_bytes(self.state_bytes_per_unit)} (conv and recurrent, any length)"
        return text

    @property
    def token_cost(self) -> int:
        """Forward 1 and backward 2 per token, as `ReplayReport.token_cost` counts what was run."""
        return sum(r.tokens * (3 if r.kind in ("step", "keep") else 1) for r in self.rows)

    @property
    def steps(self) -> int:
        return sum(1 for r in self.rows if r.kind == "step")

    def table(self, limit: int = 40) -> str:
        """The timeline as text: the first rows, the peak row, and the peak's breakdown."""
        head = f"{'#':>4} {'event':<18}" + "".join(f"{c:>14}" for c in (*CLASSES, "total"))
        lines = [head, "-" * len(head)]
        shown = list(self.rows[:limit])
        if self.rows and self.peak_step >= limit:
            shown.append(self.rows[self.peak_step])
        for r in shown:
            mark = " <- peak" if r.index == self.peak_step else ""
            cells = "".join(f"{format_bytes(r.bytes.get(c)):>14}" for c in CLASSES)
            lines.append(f"{r.index:>4} {r.label:<18}{cells}{format_bytes(r.bytes.total):>14}{mark}")
        if len(self.rows) > len(shown):
            lines.append(f"     ... {len(self.rows) - len(shown)} more rows")
        lines.append(f"peak {format_bytes(self.peak.total)} at row {self.peak_step}: {self.peak_cause}")
        if self.kv_bytes_per_token or self.state_bytes_per_unit:
            lines.append(self.resident_line())
        if self.context is not None:
            lines.append(self.context.line())
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        context = None if self.context is None else asdict(self.context)
        return {
            "context": context,
            "peak": self.peak.as_dict(),
            "peak_step": self.peak_step,
            "peak_cause": self.peak_cause,
            "budget": self.budget,
            "minimum_budget": self.minimum_budget,
            "recomputes": self.recomputes,
            "manifest_host_bytes": self.manifest_bytes,
            "resident": {
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "state_bytes_per_unit": self.state_bytes_per_unit,
            },
            "persistent": {
                "params": self.persistent.params,
                "in_flight": self.persistent.in_flight,
                "grads": self.persistent.grads,
                "optimizer": self.persistent.optimizer,
                "master": self.persistent.master,
                "reference": self.persistent.reference,
                "offloaded": self.persistent.offloaded,
            },
            "rows": [
                {"index": r.index, "tree": r.tree, "event": r.label} | r.bytes.as_dict() for r in self.rows
            ],
        }


def manifest_host_bytes(manifest: Manifest) -> int:
    """Python object bytes of the manifest's entries (measured with `sys.getsizeof`)."""
    total = sys.getsizeof(manifest.entries)
    for e in manifest.entries:
        total += sys.getsizeof(e) + sys.getsizeof(e.tree_id) + sys.getsizeof(e.trajectory_id)
    return total


@dataclass(frozen=True)
class Residency:
    """What bounds resident state in the replay a ledger predicts, beyond its `ReplayConfig`: the retention
    budget and its host tier (`RetentionPolicy(budget, host_tier=...)`) and the kept graphs."""

    budget: int | None = None
    """Retention budget in bytes (None = unbounded)."""
    host_tier: bool = False
    """Evicted KV is copied to host memory and back instead of recomputed."""
    keep_graph: KeepGraph | None = None
    """`exact` mode: the internal units whose first forward keeps its graph until their own step."""


UNBOUNDED = Residency()


def predict_ledger(
    batch: UpdateBatch,
    model: PreTrainedModel,
    replay: ReplayConfig,
    loss: LossConfig,
    *,
    residency: Residency = UNBOUNDED,
    ref_model: Reference | None = None,
    persistent: PersistentBytes | None = None,
    memory_model: MemoryModel | None = None,
) -> Ledger:
    """Predict the timeline of `TreeReplay(model, loss, replay, ...).accumulate(batch)`.

    With a reference scored in the scoring walk (`fused_reference`), its rows follow each scoring batch and
    its resident KV is booked with the policy's in prompt_group.

    `persistent` overrides the run-persistent bytes (e.g. with optimizer state under ZeRO); by default
    they are the model's (and reference model's) parameters and gradients, without an optimizer.
    `residency` is the retention budget, its host tier and the kept graphs the replay runs under.
    Raises `BudgetTooSmallError` when `residency.budget` is below the minimum.
    """
    mm = memory_model or calibrate(
        model, replay.contract, with_entropy=loss.needs_entropy, max_logit_elements=replay.max_logit_elements
    )
    ref_mm = mm
    ref_own = reference_module(ref_model)
    if ref_own is not None and ref_own.config.to_json_string() != model.config.to_json_string():
        ref_mm = calibrate(
            ref_own, replay.contract, with_entropy=False, max_logit_elements=replay.max_logit_elements
        )
    pers = persistent or model_persistent_bytes(model, ref_model=ref_model)
    fixed = ClassBytes(persistent=pers.run_persistent, boundary=pers.update_boundary)
    lp_size = max(4, next(model.parameters()).element_size())
    fused = fused_reference(loss, replay, ref_model)
    sharded = replay.context_parallel > 1
    plans = [
        plan_tree(
            work, replay, loss, kv_bytes_per_token=mm.kv_bytes_per_token,
            state_bytes_per_unit=mm.state_bytes_per_unit, budget=None if sharded else residency.budget,
            keep_graph=residency.keep_graph, host_tier=residency.host_tier, fused_reference=fused,
        )
        for work in batch.work
    ]  # fmt: skip
    walk = _Walk(mm, ref_mm, fixed, lp_size, reference=loss.needs_reference)
    context = None
    if sharded:
        rows, minimum, recomputes, context = walk.sharded(plans, replay, residency, query_bytes(model))
    else:
        rows, minimum, recomputes = walk.rows(plans)
    peak_row = max(rows, key=lambda r: r.bytes.total)
    return Ledger(
        tuple(rows), peak_row.bytes, peak_row.index, _cause(peak_row), pers, residency.budget, minimum, recomputes,
        manifest_host_bytes(batch.manifest), mm.kv_bytes_per_token, mm.state_bytes_per_unit, context,
    )  # fmt: skip


@dataclass(frozen=True)
class _Walk:
    """What every tree's walk of one ledger shares: the memory models, the fixed bytes, the logprob size."""

    mm: MemoryModel
    ref_mm: MemoryModel
    fixed: ClassBytes
    lp_size: int
    reference: bool
    """The loss needs reference logprobs (scored in a walk of their own unless fused)."""

    def rows(
        self, plans: Sequence[TreeLayout], share: ContextShare | None = None
    ) -> tuple[list[LedgerRow], int, int]:
        """(rows, minimum retention budget, recomputes) of walking `plans` in order, on one rank of a
        context group when `share` is given (its transfer buffers added to each event's temporary bytes)."""
        rows: list[LedgerRow] = []
        minimum, recomputes = 0, 0
        for t, tp in enumerate(plans):
            minimum = max(minimum, tp.retention.minimum)
            recomputes += tp.retention.recomputes
            walk = _TreeWalk(tp, self.mm, self.ref_mm, self.fixed, self.lp_size, t)
            walk.share = share
            rows.extend(walk.run(len(rows), reference=self.reference and not tp.fused_reference))
        if not rows:
            rows.append(LedgerRow(0, -1, "idle", "idle", self.fixed))
        return rows, minimum, recomputes

    def sharded(
        self, plans: Sequence[TreeLayout], replay: ReplayConfig, residency: Residency, sizes: QueryBytes
    ) -> tuple[list[LedgerRow], int, int, RankShare]:
        """`rows` on every rank of a context group of `replay.context_parallel`, each holding the units it
        owns (`ContextShare`) under `residency`'s budget: the rows of the rank with the highest peak."""
        size, kv, state = replay.context_parallel, self.mm.kv_bytes_per_token, self.mm.state_bytes_per_unit
        ranks = []
        for rank in range(size):
            share = ContextShare(size, rank, replay.chunk_size or 0, sizes)
            mine = []
            for tp in plans:
                owned = share.unit_bytes(tp.units, kv, state)
                mine.append(
                    with_resident_bytes(
                        tp, owned, residency.budget, contract=replay.contract, host_tier=residency.host_tier
                    )
                )
            ranks.append((self.rows(mine, share), share, mine))
        peaks = tuple(max(r.bytes.total for r in walked[0]) for walked, _, _ in ranks)
        top = max(range(size), key=lambda r: peaks[r])
        (rows, minimum, recomputes), share, mine = ranks[top]
        sent = sum(share.sent(ev) for tp in mine for ev in (*tp.events, *tp.reference_events))
        resident = sum(len(u) * kv for tp in plans for u in tp.units.units)
        return rows, minimum, recomputes, RankShare(size, top, sent, resident, peaks)


def _cause(row: LedgerRow) -> str:
    b = row.bytes
    biggest = max((c for c in CLASSES if c != "persistent"), key=b.get)
    what = {
        "step": "replay step (forward and backward under autograd)",
        "score": "scoring batch (no graph)",
        "reference": "reference scoring batch (no graph)",
        "recompute": "recompute of evicted KV (no graph)",
        "keep": "first forward of a kept graph",
    }.get(row.kind, row.kind)
    text = f"{row.label}, {what}; largest share {biggest} {format_bytes(b.get(biggest))}"
    s = row.shape
    if s is not None and s.rows:
        text += f" ({s.rows} branch(es) of up to {s.width} tokens against a {s.past}-token past)"
    return text


class _TreeWalk:
    """Replays one tree's events on paper, keeping the resident set as the engine will."""

    def __init__(
        self, tp: TreeLayout, mm: MemoryModel, ref_mm: MemoryModel, fixed: ClassBytes, lp_size: int, tree: int
    ) -> None:
        self.tp, self.mm, self.ref_mm, self.fixed, self.lp_size, self.tree = (
            tp,
            mm,
            ref_mm,
            fixed,
            lp_size,
            tree,
        )
        self.resident: set[int] = set()
        self.grads: set[int] = set()
        self.prompt = 0  # bytes of `resident` KV and `grads`
        self.ref_held: set[int] = set()  # the fused reference walk's own store
        self.ref_prompt = 0
        self.kept: dict[int, tuple[int, Shape]] = {}
        self.held = 0  # scores and kept graphs
        self.rows: list[LedgerRow] = []
        self.start = 0
        self.share: ContextShare | None = None
        """One rank of a context group: only its pieces are resident, and its transfer buffers are temporary."""

    def _add(self, units: Sequence[int], into: set[int]) -> None:
        for u in units:
            if u not in into:
                into.add(u)
                self.prompt += self.tp.kv_bytes[u]

    def _drop(self, units: Sequence[int], src: set[int]) -> None:
        for u in units:
            if u in src:
                src.discard(u)
                self.prompt -= self.tp.kv_bytes[u]

    def _local(self, ev: MemEvent) -> Shape:
        """The shape this rank's activations follow: on a rank of a context group, the queries attend to its
        own pieces of the past only (`ContextShare.local`)."""
        return ev.shape if self.share is None else self.share.local(self.tp.units, ev)

    def _row(self, ev: MemEvent, temporary: int, extra_prompt: int = 0) -> None:
        if self.share is not None:
            temporary += self.share.buffers(ev)
        bytes_ = self.fixed + ClassBytes(
            prompt_group=self.prompt + self.ref_prompt + extra_prompt, temporary=self.held + temporary
        )
        index = self.start + len(self.rows)
        self.rows.append(LedgerRow(index, self.tree, ev.label, ev.kind, bytes_, ev.shape, ev.tokens))

    def run(self, start: int, *, reference: bool) -> list[LedgerRow]:
        self.start = start
        by_use: dict[int, list[MemEvent]] = defaultdict(list)
        for ev in self.tp.events:
            by_use[ev.use].append(ev)
        first_step = next((i for i, u in enumerate(self.tp.uses) if u.label.startswith("step")), None)
        for i, use in enumerate(self.tp.uses):
            if reference and i == first_step:
                self._reference()
            self._drop(self.tp.retention.evict[i], self.resident)
            for ev in by_use[i]:
                self._event(ev, use.store, use.new_grads)
            self._drop(use.release, self.resident)
            self._drop(use.release, self.grads)
            for u in use.release:
                if u in self.kept:
                    self.held -= self.kept.pop(u)[0]
            if isinstance(use.event, ScoreDone) and use.event.unit in self.ref_held:
                self.ref_held.discard(use.event.unit)
                self.ref_prompt -= self.tp.kv_bytes[use.event.unit]
        return self.rows

    def _event(self, ev: MemEvent, stored: Sequence[int], new_grads: Sequence[int]) -> None:
        mm, s = self.mm, self._local(ev)
        if ev.kind == "recompute":
            self._row(ev, mm.nograd_peak(s))
            self._add(ev.units, self.resident)
        elif ev.kind == "restore":
            self._add(ev.units, self.resident)
            self._row(ev, 0)
        elif ev.kind == "keep":
            self._row(ev, mm.forward_peak(s))
            self._add(ev.units, self.resident)
            graph = mm.graph_bytes(s)
            self.kept[ev.units[0]] = (graph, s)
            self.held += graph + s.targets * self.lp_size
        elif ev.kind == "score":
            self._row(ev, mm.nograd_peak(s))
            self._add(stored, self.resident)
            self.held += s.targets * self.lp_size
        elif ev.kind == "reference":  # fused: the reference's forward of the batch, into its own store
            self._row(ev, self.ref_mm.nograd_peak(s))
            for u in ev.units:
                if self.tp.units[u].children and u not in self.ref_held:
                    self.ref_held.add(u)
                    self.ref_prompt += self.tp.kv_bytes[u]
            self.held += s.targets * self.lp_size
        else:
            extras = [mm.backward_extra(self.kept[u][1]) for u in ev.kept if u in self.kept]
            own = mm.step_peak(s)
            if extras:
                own = max(own, mm.graph_bytes(s) + max(extras))
            self._add(new_grads, self.grads)  # allocated before the step's forward
            self._row(ev, own)

    def _reference(self) -> None:
        """The reference model's scoring pass: its own store holds the current path and pending siblings."""
        units = self.tp.units
        held: set[int] = set()
        kv = self.tp.kv_bytes
        events = iter(self.tp.reference_events)
        for ev in self.tp.reference_schedule:
            if isinstance(ev, ScoreDone):
                held.discard(ev.unit)
                continue
            assert isinstance(ev, ScoreBatch)
            mev = next(events)
            self._row(mev, self.ref_mm.nograd_peak(self._local(mev)), extra_prompt=sum(kv[u] for u in held))
            held.update(c for c in ev.units if units[c].children)
            self.held += mev.shape.targets * self.lp_size
