"""Tree replay: the RL loss over a tree, with each shared unit evaluated once (docs/design.md, the exact gradient).

For one tree:
1. Scoring (no graph): old logprobs when the ratio uses them, reference logprobs when KL is on, and the
   resident KV of internal units. Without a scoring pass, KV is computed lazily when first needed. A
   reference that is the policy with its adapters off is scored in the same walk (`fused_reference`);
   any other, or with `ReplayConfig(reference_walk='separate')`, in a second walk after it.
2. The schedule's steps, post-order: K sibling units run under autograd against their parent's resident
   path. In `exact` mode the path KV enters as leaf tensors, so backward deposits dL/dKV on every ancestor
   (accumulated as G in the store). A unit with children adds <KV_unit, G_unit> to its loss, which pushes
   its descendants' gradient through its own recompute. `response_only` reads the path KV detached and
   adds no such term.
3. A unit's KV and G are released right after its own step.

Normalization comes from the manifest through the target coefficients; how units are batched or ordered
only changes the summation order.

Three optional collaborators change memory and cost, never the gradient: a `retention` policy is told each
tree's schedule and evicts resident KV before each use to stay within a byte budget (evicted KV is
recomputed from the nearest resident ancestor); `keep_graph` names internal units (in `exact` mode) whose
first forward keeps its graph until their own step, which then needs no recompute (3 token-costs instead
of 4, for a graph held longer); a `tracker` measures live bytes by lifetime class
(`treetrain.memory.tracker.MemoryTracker`) and the report carries its peak.

Example (the same sequence as `treetrain.tree_update`, spelled out):
    >>> from treetrain.loss.advantages import AdvantageConfig, compute_advantages
    >>> from treetrain.loss.manifest import Manifest
    >>> from treetrain.models.presets import tiny_model
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> trees = [synthetic_group(prefix=16, branches=3, suffix=4, depth=1, vocab=64, seed=0)]
    >>> advantages = compute_advantages(trees, AdvantageConfig()).trees  # one table per tree, not the group
    >>> loss = LossConfig()
    >>> batch = UpdateBatch.build(trees, advantages, Manifest.build(trees, version=0), loss)
    >>> engine = TreeReplay(tiny_model("llama", 64), loss, ReplayConfig(contract="exact", microbatch=2))
    >>> report = engine.accumulate(batch)
    >>> report.steps > 0, report.graph_tokens > 0
    (True, True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from treetrain.engine.batch import ReplayConfig, ReplayReport, TreeWork, UpdateBatch
from treetrain.engine.pieces import (
    GatheredTargets,
    PieceBatch,
    forward_units,
    gather_targets,
    own_kv,
    target_stats,
)
from treetrain.engine.protocols import KeepGraph, MemoryProbe, RetentionHook
from treetrain.engine.resident import ResidentIdentity, ResidentStore
from treetrain.engine.schedule import ReplayStep, active_units, build_schedule
from treetrain.engine.scoring import (
    PathKV,
    ReferenceWalk,
    ScoreBatch,
    past_before_overlap,
    reference_need,
    scoring_pass,
    scoring_schedule,
)
from treetrain.engine.units import Unit, UnitTree
from treetrain.loss.loss_config import LossConfig
from treetrain.loss.objective import Contributions, LossTerms, objective, sampler_logprobs
from treetrain.models.decoder import DecoderOutput
from treetrain.models.lora import AdaptersOff, Reference, adapters_disabled, reference_module
from treetrain.models.support import SupportGate
from treetrain.tree.stats import tree_stats

Backward = Callable[[torch.Tensor], None]


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


@dataclass
class _Graph:
    """A forward under autograd of sibling units against leaf copies of their parent path's KV."""

    units: list[Unit]
    path: tuple[int, ...]
    padded: PieceBatch
    out: DecoderOutput
    gathered: GatheredTargets
    logp: torch.Tensor  # [M]
    entropy: torch.Tensor | None  # [M]


class BackwardFailed(RuntimeError):
    """Backward failed part-way: gradients may hold a partial step. Reset the window and replay it."""


def _default_backward(loss: torch.Tensor) -> None:
    loss.backward()


class TreeReplay:
    """Accumulates parameter gradients for an update by tree replay. `optimizer.step()` is the caller's."""

    def __init__(
        self,
        model: PreTrainedModel,
        loss: LossConfig,
        replay: ReplayConfig,
        *,
        ref_model: Reference | None = None,
        identity: ResidentIdentity | None = None,
        store: ResidentStore | None = None,
        backward: Backward = _default_backward,
        check_model: bool = True,
        support: SupportGate | None = None,
        retention: RetentionHook | None = None,
        keep_graph: KeepGraph | None = None,
        tracker: MemoryProbe | None = None,
    ) -> None:
        if loss.needs_reference and ref_model is None:
            raise ValueError("loss.kl_coef > 0 needs a reference model")
        self.model = model
        self.ref_model = ref_model
        self.loss_cfg = loss
        self.cfg = replay
        self.identity = identity or ResidentIdentity.of(model)
        self.store = store or ResidentStore(self.identity)
        self.backward = backward
        self.support = (support or SupportGate()) if check_model else None
        """Refuses models the engine cannot split exactly (policy and reference); None skips the check."""
        self.device = next(model.parameters()).device
        self.step_hook: Callable[[str, ReplayStep], None] | None = None
        """Called with ("forward" | "backward", step) before each phase; tests inject faults through it."""
        self.retention = retention
        self.keep_graph = keep_graph
        self.tracker = tracker
        self._kept: dict[int, _Graph] = {}
        self.widest_step = 0
        """The most sibling rows any replay step has run with (the K in effect); the update window halves it
        after an out-of-memory error during backward."""
        self._label = ""
        if tracker is not None:
            tracker.attach_model(model)
            ref_own = reference_module(ref_model)
            if ref_own is not None:
                tracker.attach_model(ref_own)
            tracker.attach_store(self.store)

    # ----- public -----------------------------------------------------------------------------------
    def accumulate(self, batch: UpdateBatch) -> ReplayReport:
        """Run every tree of the batch; parameter `.grad`s accumulate the update's gradient."""
        if self.support is not None:
            longest = max((tree_stats(t.tree).max_sequence_length for t in batch.work), default=0)
            self.support.require(self.model, longest)
            ref_own = reference_module(self.ref_model)
            if ref_own is not None:
                self.support.require(ref_own, longest)
        report = ReplayReport()
        tracking: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.tracker is not None:
            self.tracker.reset_peak()
            if not self.tracker.active:
                tracking = self.tracker
        with tracking:
            for work in batch.work:
                report = report.merged(self._tree(work))
        if self.tracker is not None:
            report = report.merged(ReplayReport(measured_peak=self.tracker.peak))
        return report

    def _mark(self, label: str) -> None:
        if self.tracker is not None:
            self.tracker.mark(label)

    # ----- one tree ---------------------------------------------------------------------------------
    def _tree(self, work: TreeWork) -> ReplayReport:
        cfg, lcfg = self.cfg, self.loss_cfg
        units = UnitTree.build(work.tree, work.targets, cfg.chunk_size)
        skip = cfg.skip_inert and lcfg.zero_advantage_is_inert
        steps = build_schedule(
            units,
            contract=cfg.contract,
            microbatch=cfg.microbatch,
            order=cfg.order,
            seed=cfg.seed,
            skip_inert=skip,
        )
        active = active_units(units, cfg.contract, skip)
        needs_kv = self._needs_kv(units, steps)
        paths = PathKV(self.model, units, self.store, self.identity, self.device)
        report = ReplayReport(skipped_units=sum(1 for u in units.units[1:] if not active[u.index]))
        kept = self._kept_units(units, active)
        old_lp: list[torch.Tensor | None] = [None] * len(units)
        if kept:
            paths.first_forward = lambda u: self._first_forward(units, paths, u, kept, old_lp)

        scored = [u.targets.num_targets > 0 or needs_kv[u.index] for u in units.units]
        score_events = (
            scoring_schedule(units, scored, cfg.score_microbatch) if lcfg.ratio_source == "scoring" else ()
        )
        fused = fused_reference(lcfg, cfg, self.ref_model)
        if self.retention is not None:
            self.retention.begin_tree(
                units, score_events, steps, contract=cfg.contract, keep=needs_kv, kept_graphs=kept,
                evict=lambda u: self.store.evict(paths.key(u)),
                offload=lambda u: self.store.offload(paths.key(u)), model=self.model, fused_reference=fused,
            )  # fmt: skip
        ref_walk = self._reference_walk(units) if fused else None
        try:
            ref_lp: Sequence[torch.Tensor | None] = [None] * len(units)
            if lcfg.ratio_source == "scoring":
                lps, n_tok = scoring_pass(
                    self.model, paths, microbatch=cfg.score_microbatch, need=scored,
                    keep=lambda u: needs_kv[u], max_logit_elements=cfg.max_logit_elements,
                    before_batch=self._before_score, forward_elsewhere=lambda u: u in kept,
                    reference=ref_walk,
                )  # fmt: skip
                for u, lp in enumerate(lps):
                    old_lp[u] = lp if old_lp[u] is None else old_lp[u]
                report = report.merged(ReplayReport(nograd_tokens=n_tok))
            if ref_walk is not None:
                ref_lp = ref_walk.logps
                report = report.merged(ReplayReport(nograd_tokens=ref_walk.tokens))
            elif lcfg.needs_reference:
                ref_lp, n_tok = self._reference_logprobs(units)
                report = report.merged(ReplayReport(nograd_tokens=n_tok, reference_walks=1))
            for i, step in enumerate(steps):
                if self.retention is not None:
                    self.retention.before(step)
                self._label = f"step {i}"
                self._mark(self._label)
                report = report.merged(self._run_step(units, paths, step, old_lp, ref_lp))
        finally:
            self._kept.clear()
            for u in range(len(units)):
                self.store.release(paths.key(u))
            if ref_walk is not None:
                ref_walk.paths.store.clear()
            evicted = self.retention.end_tree() if self.retention is not None else 0
        return report.merged(
            ReplayReport(
                nograd_tokens=paths.recomputed_tokens,
                recomputed_units=paths.recomputed_units,
                restored_units=paths.restored_units,
                evicted_units=evicted,
                kept_graphs=len(kept),
                graph_tokens=sum(len(units[u].input_tokens) for u in kept),
            )
        )

    def _before_score(self, batch: ScoreBatch) -> None:
        if self.retention is not None:
            self.retention.before(batch)
        self._mark(f"score {batch.parent}:{batch.units[0]}")

    def _kept_units(self, units: UnitTree, active: Sequence[bool]) -> frozenset[int]:
        if self.keep_graph is None or self.cfg.contract != "exact":
            return frozenset()
        chosen = self.keep_graph(units)
        return frozenset(u for u in chosen if 0 < u < len(units) and units[u].children and active[u])

    def _first_forward(
        self, units: UnitTree, paths: PathKV, u: int, kept: frozenset[int], old_lp: list[torch.Tensor | None]
    ) -> bool:
        """Produce a kept unit's KV by its graph forward, the first time anything needs it."""
        if u not in kept or u in self._kept:
            return False
        with torch.enable_grad():
            graph = self._forward(units, paths, units[u].parent or 0, [units[u]])
        kv = [(k.detach().clone(), v.detach().clone()) for k, v in own_kv(units[u], graph.out, 0)]
        self.store.put(paths.key(u), kv, self.identity)
        old_lp[u] = graph.logp.detach()
        self._kept[u] = graph
        return True

    @staticmethod
    def _needs_kv(units: UnitTree, steps: Sequence[ReplayStep]) -> list[bool]:
        need = [False] * len(units)
        for s in steps:
            for u in units.path(s.parent):
                need[u] = True
        return need

    def _reference_walk(self, units: UnitTree) -> ReferenceWalk:
        """The reference's half of a fused scoring walk: its own store, under the identity the model has
        inside `adapters_disabled`, so its KV is never the policy's and the policy's never its."""
        assert self.ref_model is not None
        ref_model = self.ref_model
        with adapters_disabled(ref_model) as ref:
            ref_identity = ResidentIdentity.of(ref, tokenizer=self.identity.tokenizer)
        store = ResidentStore(ref_identity)
        if self.tracker is not None:
            self.tracker.attach_store(store)
        return ReferenceWalk(
            PathKV(ref, units, store, ref_identity, self.device),
            enter=lambda: adapters_disabled(ref_model),
            before_batch=lambda b: self._mark(f"reference {b.parent}:{b.units[0]}"),
        )

    def _reference_logprobs(self, units: UnitTree) -> tuple[list[torch.Tensor | None], int]:
        """The reference's logprobs, in its own store. With `AdaptersOff` the policy itself runs with its
        adapters disabled; the identity then says adapters 'off', so this KV is never the policy's."""
        assert self.ref_model is not None
        with adapters_disabled(self.ref_model) as ref:
            ref_identity = ResidentIdentity.of(ref, tokenizer=self.identity.tokenizer)
            store = ResidentStore(ref_identity)
            if self.tracker is not None:
                self.tracker.attach_store(store)
            paths = PathKV(ref, units, store, ref_identity, self.device)
            lps, n_tok = scoring_pass(
                ref, paths, microbatch=self.cfg.score_microbatch, need=reference_need(units),
                keep=lambda u: False, max_logit_elements=self.cfg.max_logit_elements,
                before_batch=lambda b: self._mark(f"reference {b.parent}:{b.units[0]}"),
            )  # fmt: skip
            store.clear()
        return lps, n_tok

    # ----- one step ---------------------------------------------------------------------------------
    def _run_step(
        self,
        units: UnitTree,
        paths: PathKV,
        step: ReplayStep,
        old_lp: Sequence[torch.Tensor | None],
        ref_lp: Sequence[torch.Tensor | None],
    ) -> ReplayReport:
        """Run a step; an out-of-memory error before backward splits it in two and retries each half.

        Before backward nothing has been accumulated, so a retry cannot double count. A failure once
        backward has started raises `BackwardFailed`: parameter gradients may hold part of the step, and
        only the caller can reset the update window.
        """
        try:
            return self._step(units, paths, step, old_lp, ref_lp)
        except torch.OutOfMemoryError:
            if len(step.units) == 1:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            half = len(step.units) // 2
            first = ReplayStep(step.parent, step.units[:half])
            second = ReplayStep(step.parent, step.units[half:])
            report = self._run_step(units, paths, first, old_lp, ref_lp)
            report = report.merged(self._run_step(units, paths, second, old_lp, ref_lp))
            return report.merged(ReplayReport(oom_splits=1))

    def _forward(self, units: UnitTree, paths: PathKV, parent: int, batch_units: list[Unit]) -> _Graph:
        """Forward sibling units under autograd against their parent's path, read in place; in `exact` the
        backward adds dL/dKV of every path piece, summed over the rows, into that piece's G accumulator."""
        path = units.path(parent)
        pieces = paths.pieces(parent) if path else []
        grads = None
        if self.cfg.contract == "exact":
            grads = [self.store.grad_buffers(paths.key(u), p, self.identity) for u, p in zip(path, pieces)]
        padded, out = forward_units(self.model, batch_units, past_before_overlap(pieces, grads), self.device)
        gathered = gather_targets([u.targets for u in batch_units], padded.input_ids.shape[1], self.device)
        logp, entropy = target_stats(
            self.model, out.hidden, gathered, with_entropy=self.loss_cfg.needs_entropy,
            max_logit_elements=self.cfg.max_logit_elements,
        )  # fmt: skip
        return _Graph(batch_units, path, padded, out, gathered, logp, entropy)

    def _loss(
        self,
        paths: PathKV,
        graph: _Graph,
        old_lp: Sequence[torch.Tensor | None],
        ref_lp: Sequence[torch.Tensor | None],
    ) -> tuple[LossTerms, torch.Tensor]:
        """The graph's RL loss terms, and the scalar to backpropagate (plus <KV, G> in `exact` mode)."""
        lcfg, logp, batch_units = self.loss_cfg, graph.logp, graph.units
        given = graph.gathered.contributions
        old = self._old_logprobs(given, batch_units, old_lp, logp)
        ref = self._cat([ref_lp[u.index] for u in batch_units], logp) if lcfg.needs_reference else None
        contrib = Contributions(given.target, given.coef, given.advantage, old)
        terms = objective(lcfg, logp, contrib, entropy=graph.entropy, ref_logprob=ref)
        total = terms.loss
        if self.cfg.contract == "exact":
            for row, unit in enumerate(batch_units):
                grad = self.store.grad(paths.key(unit.index), self.identity) if unit.children else None
                if grad is None:
                    continue
                for (k_new, v_new), (gk, gv) in zip(own_kv(unit, graph.out, row), grad):
                    total = total + (k_new * gk).sum() + (v_new * gv).sum()
        return terms, total

    def _step(
        self,
        units: UnitTree,
        paths: PathKV,
        step: ReplayStep,
        old_lp: Sequence[torch.Tensor | None],
        ref_lp: Sequence[torch.Tensor | None],
    ) -> ReplayReport:
        fresh = [units[u] for u in step.units if u not in self._kept]
        self.widest_step = max(self.widest_step, len(step.units))
        if self.step_hook is not None:
            self.step_hook("forward", step)
        graphs = [self._kept[u] for u in step.units if u in self._kept]
        if fresh:
            graphs.insert(0, self._forward(units, paths, step.parent, fresh))
        parts = [self._loss(paths, g, old_lp, ref_lp) for g in graphs]
        total = parts[0][1]
        for _, t in parts[1:]:
            total = total + t

        if self.step_hook is not None:
            self.step_hook("backward", step)
        self._mark(f"{self._label} backward")
        try:  # from here on, parameter gradients may hold part of this step: no retry can be local
            if total.requires_grad:
                self.backward(total)
        except Exception as exc:
            raise BackwardFailed(f"backward of step {step} failed; the update window must be reset") from exc
        for u in step.units:
            self._kept.pop(u, None)
            self.store.release(paths.key(u))
        losses = [t for t, _ in parts]
        return ReplayReport(
            loss=sum(float(t.loss.detach()) for t in losses),
            pg=sum(t.pg for t in losses),
            kl=sum(t.kl for t in losses),
            entropy=sum(t.entropy for t in losses),
            clipped=sum(t.clipped for t in losses),
            graph_tokens=sum(graphs[0].padded.lengths) if fresh else 0,
            steps=1,
        )

    def _old_logprobs(
        self,
        contrib: Contributions,
        batch_units: Sequence,
        old_lp: Sequence[torch.Tensor | None],
        logp: torch.Tensor,
    ) -> torch.Tensor:
        if self.loss_cfg.ratio_source == "sampler":
            return sampler_logprobs(contrib)
        per_target = self._cat([old_lp[u.index] for u in batch_units], logp)
        return per_target[contrib.target]

    @staticmethod
    def _cat(parts: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        tensors = [p for p in parts if p is not None]
        if not tensors:
            return like.new_zeros(0)
        return torch.cat(tensors).to(like.dtype)
