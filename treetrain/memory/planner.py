"""The planner: K, chunk size, retention and kept graphs for an update, and tree or flat mode.

Given the trees of an update, a model, a contract and a device memory budget, `plan_update` searches:

- tree mode: K (siblings per replay step), chunk size, a retention budget for resident state, and per
  internal unit whether its first forward keeps its graph (one token-cost less per token, a graph held
  longer); every candidate is priced by its ledger (`predict_ledger`) and its token cost;
- flat mode: the microbatch of calls (`predict_flat`).

With KL and a reference that is the policy with its adapters off, tree mode scores the reference in the
scoring walk, both KV sets resident together and budgeted together; when no such candidate fits, the
search is repeated with the reference in a second walk, and the plan says so.

A candidate fits when its ledger peak is at most the budget. Among fitting tree candidates the cheapest
in tokens wins (then fewer, larger steps; then the lower peak). The geometry advisor then compares the
modes: tree is chosen when it fits and its token-ceiling speedup over flat is at least `min_speedup`,
flat when it fits and tree does not, or when tree's gain is below that: the ceiling ignores per-step
overheads and attention's quadratic term, so a thin margin is not worth the tree's resident state.
`Plan.explain()` says which and why, with both costs. Any choice can be forced (`Overrides`).

Costs are in token units (forward 1, backward 2 per token, as `ReplayReport.token_cost` counts);
`flops` converts them with the usual 2 x parameters per token forward.

Example:
    >>> plan = plan_update(batch, model, budget=8 << 30, base=ReplayConfig(contract="exact"))  # doctest: +SKIP
    >>> print(plan.explain())                                                  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from transformers import PreTrainedModel

from treetrain.bytesize import format_bytes
from treetrain.errors import TreetrainError
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.context_need import context_needed, needed_line
from treetrain.memory.ledger import Ledger
from treetrain.memory.overrides import Mode, Overrides
from treetrain.memory.persistent import PersistentBytes
from treetrain.memory.plan_search import (
    Candidate,
    TreeSearch,
    chunk_candidates,
    k_candidates,
    search_flat,
    search_tree,
)
from treetrain.memory.replay_layout import Layout, lay_out
from treetrain.memory.retention import BudgetTooSmallError
from treetrain.models.attention import shared_past_kernel_note, shared_past_reason
from treetrain.models.lora import Reference
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.reference import fused_reference
from treetrain.replay.replay_schedule import ReplaySchedule
from treetrain.replay.schedule import Contract
from treetrain.replay.units import UnitTree


class PlanError(TreetrainError, ValueError):
    """No candidate fits the budget; the message names the smallest peak found."""


@dataclass(frozen=True)
class ModeCost:
    """What one mode costs under its best configuration."""

    mode: Mode
    token_cost: int
    """Forward 1, backward 2 per token; no-grad forwards (scoring, recompute) 1."""
    flops: float
    """token_cost x 2 x parameters."""
    peak: int
    """Ledger peak, bytes."""
    fits: bool


@dataclass(frozen=True)
class Plan:
    """The planner's decision for one update: the one plan of the update, from settings to replayer."""

    mode: Mode
    config: ReplayConfig
    """How to replay: the run's fixed settings (contract, scoring microbatch, logits chunk) and the chosen K
    (tree mode: sibling units per step; flat mode: calls per microbatch), chunk size and reference walk."""
    retention: int | None
    """Retention budget in bytes (None = unbounded)."""
    keep_graph: frozenset[tuple[str, int]]
    """(tree id, unit index) of internal units whose first forward keeps its graph."""
    budget: int
    tree: ModeCost
    flat: ModeCost
    ledger: Ledger
    """The chosen mode's predicted timeline."""
    min_speedup: float
    reasons: tuple[str, ...] = ()
    forced: tuple[str, ...] = ()
    attention: str = ""
    """How tree mode attends over resident KV (shared-past attention, or why the past is concatenated)."""

    @property
    def contract(self) -> Contract:
        return self.config.contract

    @property
    def microbatch(self) -> int:
        """K in tree mode (0 = all siblings), calls per microbatch in flat mode."""
        return self.config.microbatch

    @property
    def chunk_size(self) -> int | None:
        return self.config.chunk_size

    @property
    def reference_walk(self) -> Literal["fused", "separate"]:
        """Tree mode with KL: the reference scored in the scoring walk, or in a second walk (module doc)."""
        return self.config.reference_walk

    @property
    def speedup(self) -> float:
        """Token-ceiling speedup of tree mode over flat."""
        return self.flat.token_cost / max(1, self.tree.token_cost)

    def narrower(self, k: int) -> Plan:
        """The same decision with at most `k` sibling rows per replay step (after an out-of-memory error in
        backward, which a split inside the step cannot undo)."""
        return replace(self, config=replace(self.config, microbatch=k))

    def lay_out(
        self, batch: UpdateBatch, model: PreTrainedModel, loss: LossConfig, ref_model: Reference | None = None
    ) -> Layout:
        """This plan over `batch` (one rank's share): each tree's steps, kept graphs and evictions. Flat mode
        has nothing to lay out."""
        if self.mode == "flat":
            return Layout(ReplaySchedule())
        keep = KeptGraphs(self.keep_graph) if self.keep_graph else None
        return lay_out(
            batch, model, loss, self.config, retention=self.retention, keep_graph=keep, ref_model=ref_model
        )

    @property
    def over_budget(self) -> str | None:
        """Why this plan cannot run within its budget, in one line naming the smallest predicted peak, the
        budget and what to change; None when it fits. Only a forced mode gets here (the planner never chooses
        a mode that does not fit): the trainer refuses such a plan, `treetrain plan` shows this line."""
        chosen, other = (self.tree, self.flat) if self.mode == "tree" else (self.flat, self.tree)
        if chosen.fits:
            return None
        instead = (
            f"set mode=auto (or mode={other.mode}, whose peak {format_bytes(other.peak)} fits)"
            if other.fits
            else "lower the update's size (rollout.groups_per_update, the episode budgets)"
        )
        return (
            f"mode={self.mode} was forced, and its smallest predicted peak {format_bytes(chosen.peak)} exceeds "
            f"memory_budget {format_bytes(self.budget)}: raise memory_budget to at least "
            f"{format_bytes(chosen.peak)}, or {instead}"
        )

    def explain(self) -> str:
        t, f = self.tree, self.flat
        lines = [
            f"mode: {self.mode} ({self.contract})"
            + (f"  [forced: {', '.join(self.forced)}]" if self.forced else ""),
            f"  tree: {t.token_cost} token-units ({t.flops:.3g} FLOPs), peak {format_bytes(t.peak)}"
            + ("" if t.fits else f"  exceeds the {format_bytes(self.budget)} budget"),
            f"  flat: {f.token_cost} token-units ({f.flops:.3g} FLOPs), peak {format_bytes(f.peak)}"
            + ("" if f.fits else f"  exceeds the {format_bytes(self.budget)} budget"),
            f"  token-ceiling speedup of tree over flat: {self.speedup:.2f}x (tree needs >= {self.min_speedup:.2f}x)",
        ]
        if self.mode == "tree":
            retention = "unbounded" if self.retention is None else format_bytes(self.retention)
            lines.append(
                f"  K={self.microbatch or 'all'}, chunk size={self.chunk_size or 'none'}, retention={retention}, "
                f"kept graphs={len(self.keep_graph)}"
            )
        else:
            lines.append(f"  calls per microbatch={self.microbatch}")
        lines += [f"  because {r}" for r in self.reasons]
        if self.over_budget is not None:
            lines.append(f"  refused by train: {self.over_budget}")
        if self.attention:
            lines.append(f"  attention against resident KV: {self.attention}")
        if self.ledger.context is not None:
            lines.append(f"  {self.ledger.context.line()}")
        return "\n".join(lines)


@dataclass(frozen=True)
class KeptGraphs:
    """The engine's `keep_graph` for a plan: the chosen (tree id, unit) pairs, looked up per tree."""

    chosen: frozenset[tuple[str, int]]

    def __call__(self, units: UnitTree) -> frozenset[int]:
        return frozenset(u for t, u in self.chosen if t == units.tree.id)


def _lower(a: Candidate | None, b: Candidate | None) -> bool:
    """Whether `a` has a strictly lower peak than `b` (a missing `b` is beaten by any `a`): when neither walk
    fits, the plan (and a refusal's "smallest predicted peak") takes the walk that comes closer."""
    if a is None:
        return b is None
    return b is None or a.ledger.peak.total < b.ledger.peak.total


def plan_update(
    batch: UpdateBatch,
    model: PreTrainedModel,
    *,
    budget: int,
    loss: LossConfig | None = None,
    overrides: Overrides | None = None,
    ref_model: Reference | None = None,
    persistent: PersistentBytes | None = None,
    base: ReplayConfig | None = None,
    min_speedup: float = 1.25,
) -> Plan:
    """Choose mode, K, chunk size, retention and kept graphs for `batch` within `budget` bytes.

    `base` is the replay config the run fixes (`ReplaySection.replay_config`: the contract, the scoring
    microbatch, the logits chunk, the seed); the plan's `config` is it with K, chunk size and the reference
    walk filled in.

    Raises `PlanError` (naming the smallest peak found) when neither mode fits, and `BudgetTooSmallError`
    when a forced retention budget (with K and chunk size forced too) is below the minimum.
    """
    loss = loss or LossConfig()
    ov = overrides or Overrides()
    base = base or ReplayConfig()
    contract = base.contract
    if budget <= 0:
        raise ValueError(f"budget must be > 0 bytes, got {budget}")
    params = sum(p.numel() for p in model.parameters())
    flops = 2.0 * params

    tree_cand: Candidate | None = None
    fused = fused_reference(loss, base, ref_model)
    walk_note = ""
    if ov.mode != "flat":
        ks = [ov.microbatch] if ov.microbatch is not None else k_candidates(batch)
        chunks = [ov.chunk] if ov.chunk_size is not None else chunk_candidates(batch, base.context_parallel)

        def search(walk: Literal["fused", "separate"]) -> tuple[TreeSearch, Candidate | None]:
            s = TreeSearch(
                batch, model, loss, replace(base, reference_walk=walk), budget, persistent, ref_model
            )
            return s, search_tree(s, contract, ks, chunks, ov.retention, ov.keep_graphs)

        if fused:
            try:
                one, tree_cand = search("fused")
            except BudgetTooSmallError:  # a forced retention below the fused minimum: two walks may fit
                one, tree_cand = None, None
            if one is None or not one.fits(tree_cand):
                two, separate = search("separate")
                if two.fits(separate) or one is None or _lower(two.smallest, one.smallest):
                    smallest = one.smallest if one is not None else None
                    tree_cand, fused = separate or two.smallest, False
                    walk_note = (
                        "the reference (adapters off) runs as a second walk: in the scoring walk its KV and "
                        "the policy's do not fit together"
                        + (f" (smallest peak {format_bytes(smallest.ledger.peak.total)})" if smallest else "")
                    )
                else:
                    tree_cand = tree_cand or one.smallest
            elif tree_cand is not None:
                walk_note = (
                    "the reference (adapters off) is scored in the scoring walk: its KV and the policy's are "
                    "resident, and budgeted, together"
                )
        else:
            one, tree_cand = search("separate")
            tree_cand = tree_cand or one.smallest
    flat_mb, flat_ledger, flat_cost = search_flat(
        batch, model, loss, budget, ov.microbatch if ov.mode == "flat" else None, persistent, ref_model,
        base.max_logit_elements,
    )  # fmt: skip
    flat = ModeCost(
        "flat", flat_cost, flat_cost * flops, flat_ledger.peak.total, flat_ledger.peak.total <= budget
    )
    if tree_cand is None:  # tree forced off
        tree = ModeCost("tree", 0, 0.0, 0, False)
    else:
        tl = tree_cand.ledger
        tree = ModeCost("tree", tl.token_cost, tl.token_cost * flops, tl.peak.total, tl.peak.total <= budget)
    if tree_cand is None:
        speedup = 0.0
    else:  # a tree with nothing to replay (every branch inert) costs nothing: any speedup is enough
        speedup = flat.token_cost / tree.token_cost if tree.token_cost else float("inf")

    reasons: list[str] = []
    if ov.mode is not None:
        mode: Mode = ov.mode
        reasons.append(f"the mode was forced to {mode}")
    elif tree.fits and (not flat.fits or speedup >= min_speedup):
        mode = "tree"
        if flat.fits:
            reasons.append(
                f"tree fits and its token-ceiling speedup {speedup:.2f}x is at least {min_speedup:.2f}x"
            )
        else:
            reasons.append(f"only tree fits the {format_bytes(budget)} budget")
    elif flat.fits:
        mode = "flat"
        if tree.fits:
            reasons.append(
                f"tree's token-ceiling speedup is only {speedup:.2f}x (< {min_speedup:.2f}x): the suffixes dominate "
                "and sharing saves too little to pay for resident state and per-step overheads"
            )
        else:
            reasons.append(f"tree's smallest peak {format_bytes(tree.peak)} exceeds the budget; flat fits")
    else:
        needed = (
            None
            if ov.mode == "flat"
            else context_needed(batch, model, loss, base, budget, persistent, ref_model)
        )
        raise PlanError(
            f"nothing fits the {format_bytes(budget)} budget: the smallest predicted peak is "
            f"{format_bytes(tree.peak)} in tree mode and {format_bytes(flat.peak)} in flat mode"
            + ("" if needed is None else f"; the tree {needed_line(needed)}")
        )
    if mode == "tree":
        assert tree_cand is not None
        c = tree_cand
        if c.retention is not None:
            reasons.append(f"resident state is bounded to {format_bytes(c.retention)} so the peak fits")
        if c.keep:
            reasons.append(f"{len(c.keep)} internal unit(s) keep their first graph: no recompute for them")
        if walk_note:
            reasons.append(walk_note)
        walk: Literal["fused", "separate"] = "fused" if fused else "separate"
        config = replace(base, microbatch=c.microbatch, chunk_size=c.chunk, reference_walk=walk)
        return Plan(
            "tree", config, c.retention, c.keep, budget, tree, flat, c.ledger, min_speedup, tuple(reasons),
            ov.forced(), attention_note(model),
        )  # fmt: skip
    config = replace(base, microbatch=flat_mb, chunk_size=None, reference_walk="fused")
    return Plan(
        "flat", config, None, frozenset(), budget, tree, flat, flat_ledger, min_speedup, tuple(reasons),
        ov.forced(), attention_note(model),
    )  # fmt: skip


def attention_note(model: PreTrainedModel) -> str:
    """What `treetrain plan` says about attention against resident KV for `model`."""
    reason = shared_past_reason(model)
    if reason is None:
        kernel = shared_past_kernel_note(model)
        how = "" if kernel is None else f"; on the plain-PyTorch reference kernel, because {kernel}"
        return f"shared-past (each resident piece read once per step, the K rows' queries stacked against it){how}"
    return f"concatenated and broadcast to the K rows (the slower, larger path), because {reason}"
