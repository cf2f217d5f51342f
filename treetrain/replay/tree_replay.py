"""Tree replay: the RL loss over a tree, with each shared unit evaluated once (docs/design.md, the exact gradient).

For one tree, the three steps of the exact algorithm (`TreeReplay._tree`):

1. **Score** (`_score`, no graph): every needed unit forwarded once against its resident ancestors. It
   yields old logprobs when the ratio uses them, reference logprobs when KL is on, and the resident KV of
   internal units. A reference that is the policy with its adapters off is scored in the same walk
   (`fused_reference`); any other, or with `ReplayConfig(reference_walk='separate')`, in a second walk.
2. **Replay** (`_replay`, under autograd): the schedule's steps, post-order. K sibling units run against
   their parent's resident path. In `exact` mode the path KV enters as leaf tensors, so backward deposits
   dL/dKV on every ancestor, accumulated as G in the store.
3. **Close** (`_close`): a unit with children adds <KV_unit, G_unit> to its own step's loss, which
   pushes its descendants' gradient through its recompute. `response_only` reads the path KV detached and
   adds no such term. A unit's KV and G are released right after its own step.

Normalization comes from the manifest through the target coefficients; how units are batched or ordered
only changes the summation order.

The schedule (`ReplaySchedule`, given to `accumulate`) changes memory and cost, never the gradient, and
the replayer carries it out without deciding anything about memory: each tree's `TreeSchedule` lists the resident KV to evict (or
offload to host memory) before each scoring batch and step, so that resident bytes stay within the
planner's budget (evicted KV is recomputed from the nearest resident ancestor), and the internal units (in
`exact` mode) whose first forward keeps its graph until their own step, which then needs no recompute (3
token-costs instead of 4, for a graph held longer). A schedule made for another walk is refused
(`PlanMismatchError`). A `hooks.tracker` measures live bytes by lifetime class
(`treetrain.memory.tracker.MemoryTracker`) and the report carries its peak.

Example (the same sequence as `treetrain.tree_update`, spelled out):
    >>> from treetrain.loss.advantages import AdvantageConfig, compute_advantages
    >>> from treetrain.models.presets import tiny_model
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> trees = [synthetic_group(prefix=16, branches=3, suffix=4, depth=1, vocab=64, seed=0)]
    >>> advantages = compute_advantages(trees, AdvantageConfig()).trees  # one table per tree, not the group
    >>> loss = LossConfig()
    >>> batch = UpdateBatch.build(trees, advantages, loss)
    >>> engine = TreeReplay(tiny_model("llama", 64), loss, ReplayConfig(contract="exact", microbatch=2))
    >>> report = engine.accumulate(batch)
    >>> report.steps > 0, report.graph_tokens > 0
    (True, True)
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from treetrain.loss.loss_config import LossConfig
from treetrain.loss.objective import Contributions, LossTerms, objective, sampler_logprobs
from treetrain.loss.sampler_correction import correction_weights
from treetrain.models.layer_entry import entry_tensors, grad_tensors, map_entry
from treetrain.models.lora import Reference, reference_module
from treetrain.models.support import SupportGate
from treetrain.replay.batch import ReplayConfig, ReplayReport, TreeWork, UpdateBatch
from treetrain.replay.context_replay import ContextShards, require_shardable
from treetrain.replay.pieces import (
    forward_units,
    gather_targets,
    own_kv,
    target_stats,
)
from treetrain.replay.reference import (
    ReferenceView,
    fused_reference,
    fused_reference_walk,
    separate_reference_logprobs,
)
from treetrain.replay.replay_schedule import ReplayHooks, ReplaySchedule, ScheduleRun, TreeSchedule
from treetrain.replay.resident import ResidentIdentity, ResidentStore
from treetrain.replay.schedule import ReplayStep
from treetrain.replay.scoring import (
    LogitSettings,
    PathKV,
    ScoreBatch,
    past_before_overlap,
    scoring_pass,
)
from treetrain.replay.units import Unit
from treetrain.replay.walk import StepGraph, TreeWalk
from treetrain.tree.stats import tree_stats

Backward = Callable[[torch.Tensor], None]


class BackwardFailed(RuntimeError):
    """Backward failed part-way: gradients may hold a partial step. Reset the window and replay it."""


def _default_backward(loss: torch.Tensor) -> None:
    loss.backward()


class TreeReplay:
    """Accumulates parameter gradients for an update by tree replay. `optimizer.step()` is the caller's.

    `config` is how to replay (contract, K, chunking, order); `accumulate` takes this rank's `ReplaySchedule`
    when the plan bounds memory or keeps graphs. `store` holds resident state under its
    identity (a fresh one for the model if omitted); `support` remembers which models were checked (pass
    `SupportGate(trusting=True)` for a model known to split exactly); `hooks` are called at fixed points
    (tests inject faults through them), and `hooks.backward` runs each step's backward (the update window
    routes it through the training backend).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        loss: LossConfig,
        config: ReplayConfig | None = None,
        *,
        ref_model: Reference | None = None,
        store: ResidentStore | None = None,
        support: SupportGate | None = None,
        hooks: ReplayHooks | None = None,
    ) -> None:
        if loss.needs_reference and ref_model is None:
            raise ValueError("loss.kl_coef > 0 needs a reference model")
        self.model = model
        self.ref_model = ref_model
        self.loss_cfg = loss
        self.cfg = config or ReplayConfig()
        """Contract, K, chunking, order, reference walk."""
        self.store = store or ResidentStore(ResidentIdentity.of(model))
        self.support = support or SupportGate()
        """Refuses models the engine cannot split exactly (policy and reference)."""
        self.device = next(model.parameters()).device
        self.hooks = hooks or ReplayHooks()
        self.backward: Backward = self.hooks.backward or _default_backward
        self.shards = ContextShards.of_store(self.store, self.cfg.chunk_size, model)
        """This rank's context group (`context_replay`): it keeps only the resident KV it owns, the
        reference's too."""
        ref_own = reference_module(ref_model)
        if self.shards is not None and ref_own is not None:
            require_shardable(ref_own)
        self._widest = 0
        self._evictions: ScheduleRun | None = None
        self._schedule: ReplaySchedule | None = None
        self._label = ""
        tracker = self.hooks.tracker
        if tracker is not None:
            tracker.attach_model(model)
            if ref_own is not None:
                tracker.attach_model(ref_own)
            tracker.attach_store(self.store)

    @property
    def widest_step(self) -> int:
        """The most sibling rows any replay step of this engine has run with (the K in effect); the update
        window plans a narrower K from it after an out-of-memory error during backward."""
        return self._widest

    @property
    def identity(self) -> ResidentIdentity:
        """The identity resident state is read and written under: the store's."""
        return self.store.identity

    # ----- public -----------------------------------------------------------------------------------
    def accumulate(self, batch: UpdateBatch, schedule: ReplaySchedule | None = None) -> ReplayReport:
        """Run every tree of the batch; parameter `.grad`s accumulate the update's gradient. `schedule`, if
        given, has each tree's evictions and kept graphs (None: nothing bounded or kept)."""
        self._schedule = schedule
        longest = max((tree_stats(t.tree).max_sequence_length for t in batch.work), default=0)
        self.support.require(self.model, longest)
        ref_own = reference_module(self.ref_model)
        if ref_own is not None:
            self.support.require(ref_own, longest)
        if self.shards is not None:
            self._agree(batch, schedule)
        report = ReplayReport()
        tracker = self.hooks.tracker
        tracking: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if tracker is not None:
            tracker.reset_peak()
            if not tracker.active:
                tracking = tracker
        crossed = self.shards.crossed() if self.shards is not None else 0
        with tracking:
            for work in batch.work:
                report = report.merged(self._tree(work))
        if self.shards is not None:
            report = report.merged(ReplayReport(crossed_bytes=self.shards.crossed() - crossed))
        if tracker is not None:
            report = report.merged(ReplayReport(measured_peak=tracker.peak))
        return report

    def _agree(self, batch: UpdateBatch, schedule: ReplaySchedule | None) -> None:
        """The ranks of this context group are about to replay the same trees with the same weights, settings
        and schedule (each rank plans its own; a kept graph or an eviction changes how many forwards, and so
        collectives, run), or `GroupMismatchError` (see `ContextExchange.agree`)."""
        assert self.shards is not None
        digest = hashlib.sha256(repr(self.cfg).encode())
        for work in batch.work:
            digest.update(f"{work.tree.id}:{sorted(work.trajectories)}".encode())
        for tree in schedule.trees if schedule is not None else ():
            evictions = [(repr(e.before), e.units) for e in tree.evictions]
            canonical = (tree.tree_id, repr(tree.steps), sorted(tree.kept), evictions, tree.offload)
            digest.update(repr(canonical).encode())
        identity = self.store.identity
        self.shards.exchange.agree(
            "(model version, adapter version, trees, settings and schedule)",
            (identity.model_version, identity.adapter_version, int(digest.hexdigest()[:15], 16)),
            self.device,
        )

    def _mark(self, label: str) -> None:
        if self.hooks.tracker is not None:
            self.hooks.tracker.mark(label)

    # ----- one tree: the three steps ----------------------------------------------------------------
    def _tree(self, work: TreeWork) -> ReplayReport:
        schedule = None if self._schedule is None else self._schedule.for_tree(work.tree.id)
        walk = self._walk(work, schedule)
        evictions = None
        if schedule is not None:
            move = self.store.offload if schedule.offload else self.store.evict
            evictions = ScheduleRun(schedule, lambda u: move(walk.paths.key(u)))
        self._evictions = evictions
        report = ReplayReport(skipped_units=walk.skipped)
        try:
            # 1. Score: every needed unit once, without a graph (old and reference logprobs, resident KV).
            report = report.merged(self._score(walk))
            report = report.merged(ReplayReport(sampler_gap=walk.sampler_terms(self.loss_cfg, work)))
            # 2 and 3. Replay post-order: K siblings under autograd against resident KV (G accumulates on
            # every ancestor); a unit with children closes with <KV, G> in its own step.
            for i, step in enumerate(walk.steps):
                if evictions is not None:
                    evictions.before(step)
                self._label = f"step {i}"
                self._mark(self._label)
                report = report.merged(self._replay(walk, step))
        finally:
            walk.graphs.clear()
            for u in range(len(walk.units)):
                self.store.release(walk.paths.key(u))
            if walk.reference is not None:
                walk.reference.paths.store.clear()
            self._evictions = None
        evicted = evictions.evicted if evictions is not None else 0
        paths = walk.paths
        return report.merged(
            ReplayReport(
                nograd_tokens=paths.recomputed_tokens,
                recomputed_units=paths.recomputed_units,
                restored_units=paths.restored_units,
                evicted_units=evicted,
                kept_graphs=len(walk.kept),
                graph_tokens=sum(len(walk.units[u].input_tokens) for u in walk.kept),
            )
        )

    def _walk(self, work: TreeWork, schedule: TreeSchedule | None) -> TreeWalk:
        walk = TreeWalk.build(work, self.cfg, schedule, skip_inert=self._skip_inert)
        walk.paths = PathKV(
            self.model, walk.units, self.store, self.identity, self.device,
            produce=partial(self._first_forward, walk) if walk.kept else None, shards=self.shards,
        )  # fmt: skip
        return walk

    @property
    def _skip_inert(self) -> bool:
        return self.cfg.skip_inert and self.loss_cfg.zero_advantage_is_inert

    # ----- step 1: score ----------------------------------------------------------------------------
    def _score(self, walk: TreeWalk) -> ReplayReport:
        """Old logprobs (with a scoring pass), reference logprobs (with KL) and the resident KV of internal
        units, all without a graph. Without a scoring pass, KV is computed lazily when a step first needs it."""
        lcfg, cfg = self.loss_cfg, self.cfg
        report = ReplayReport()
        ref_walk = None
        if fused_reference(lcfg, cfg, self.ref_model):
            assert self.ref_model is not None
            ref_walk = walk.reference = fused_reference_walk(
                self.ref_model, walk.units, self._reference_view()
            )
        if lcfg.ratio_source == "scoring":
            lps, n_tok = scoring_pass(
                walk.paths, microbatch=cfg.score_microbatch, need=walk.scored,
                keep=lambda u: walk.needs_kv[u],
                logits=LogitSettings(cfg.max_logit_elements, lcfg.logit_temperature),
                before_batch=self._before_score, forward_elsewhere=lambda u: u in walk.kept,
                reference=ref_walk,
            )  # fmt: skip
            walk.old_lp = [old if old is not None else lp for old, lp in zip(walk.old_lp, lps)]
            report = report.merged(ReplayReport(nograd_tokens=n_tok))
        if ref_walk is not None:
            walk.ref_lp = ref_walk.logps
            report = report.merged(ReplayReport(nograd_tokens=ref_walk.tokens))
        elif lcfg.needs_reference:
            assert self.ref_model is not None
            walk.ref_lp, n_tok = separate_reference_logprobs(
                self.ref_model, walk.units, self._reference_view()
            )
            report = report.merged(ReplayReport(nograd_tokens=n_tok, reference_walks=1))
        else:
            walk.ref_lp = [None] * len(walk.units)
        return report

    def _reference_view(self) -> ReferenceView:
        return ReferenceView(
            self.identity.tokenizer,
            self.device,
            self.cfg.score_microbatch,
            self.cfg.max_logit_elements,
            self.loss_cfg.logit_temperature,
            self.hooks.tracker,
            lambda b: self._mark(f"reference {b.parent}:{b.units[0]}"),
            self.shards,
        )

    def _before_score(self, batch: ScoreBatch) -> None:
        if self._evictions is not None:
            self._evictions.before(batch)
        self._mark(f"score {batch.parent}:{batch.units[0]}")

    def _first_forward(self, walk: TreeWalk, u: int) -> bool:
        """Produce a kept unit's KV by its graph forward, the first time anything needs it."""
        if u not in walk.kept or u in walk.graphs:
            return False
        units = walk.units
        with torch.enable_grad():
            graph = self._forward(walk, units[u].parent or 0, [units[u]])
        walk.paths.put(
            u, [map_entry(lambda t: t.detach().clone(), e) for e in own_kv(units[u], graph.out, 0)]
        )
        walk.old_lp[u] = graph.logp.detach()
        walk.graphs[u] = graph
        return True

    # ----- step 2: replay ---------------------------------------------------------------------------
    def _replay(self, walk: TreeWalk, step: ReplayStep) -> ReplayReport:
        """Run a step; an out-of-memory error before backward splits it in two and retries each half.

        Before backward nothing has been accumulated, so a retry cannot double count. A failure once
        backward has started raises `BackwardFailed`: parameter gradients may hold part of the step, and
        only the caller can reset the update window.
        """
        try:
            return self._step(walk, step)
        except torch.OutOfMemoryError:
            if len(step.units) == 1 or self.shards is not None:  # a group's ranks split alike or not at all
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            half = len(step.units) // 2
            report = self._replay(walk, ReplayStep(step.parent, step.units[:half]))
            report = report.merged(self._replay(walk, ReplayStep(step.parent, step.units[half:])))
            return report.merged(ReplayReport(oom_splits=1))

    def _forward(self, walk: TreeWalk, parent: int, batch_units: list[Unit]) -> StepGraph:
        """Forward sibling units under autograd against their parent's path, read in place; in `exact` the
        backward adds dL/dKV of every path piece, summed over the rows, into that piece's G accumulator."""
        paths = walk.paths
        path = walk.units.path(parent)
        pieces = paths.pieces(parent) if path else []
        grads = None
        if self.cfg.contract == "exact":
            grads = [self.store.grad_buffers(paths.key(u), p, self.identity) for u, p in zip(path, pieces)]
        past = past_before_overlap(pieces, grads, recurrent=paths.recurrent, exchange=paths.exchange)
        padded, out = forward_units(self.model, batch_units, past, self.device)
        gathered = gather_targets([u.targets for u in batch_units], padded.input_ids.shape[1], self.device)
        logp, entropy = target_stats(
            self.model, out.hidden, gathered, with_entropy=self.loss_cfg.needs_entropy,
            max_logit_elements=self.cfg.max_logit_elements, temperature=self.loss_cfg.logit_temperature,
        )  # fmt: skip
        return StepGraph(batch_units, path, padded, out, gathered, logp, entropy)

    def _step(self, walk: TreeWalk, step: ReplayStep) -> ReplayReport:
        fresh = [walk.units[u] for u in step.units if u not in walk.graphs]
        self._widest = max(self._widest, len(step.units))
        hook = self.hooks.step
        if hook is not None:
            hook("forward", step)
        graphs = [walk.graphs[u] for u in step.units if u in walk.graphs]
        if fresh:
            graphs.insert(0, self._forward(walk, step.parent, fresh))
        parts = [self._loss(walk, g) for g in graphs]
        total = parts[0][1]
        for _, t in parts[1:]:
            total = total + t

        if hook is not None:
            hook("backward", step)
        self._mark(f"{self._label} backward")
        try:  # from here on, parameter gradients may hold part of this step: no retry can be local
            if total.requires_grad:
                self.backward(total)
        except Exception as exc:
            raise BackwardFailed(f"backward of step {step} failed; the update window must be reset") from exc
        for u in step.units:
            walk.graphs.pop(u, None)
            self.store.release(walk.paths.key(u))
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

    def _loss(self, walk: TreeWalk, graph: StepGraph) -> tuple[LossTerms, torch.Tensor]:
        """The graph's RL loss terms, and the scalar to backpropagate (plus <KV, G> in `exact` mode)."""
        lcfg, logp, batch_units = self.loss_cfg, graph.logp, graph.units
        given = graph.gathered.contributions
        old = self._old_logprobs(given, batch_units, walk.old_lp, logp)
        ref = self._cat([walk.ref_lp[u.index] for u in batch_units], logp) if lcfg.needs_reference else None
        contrib = Contributions(given.target, given.coef, given.advantage, old)
        kept = None
        if walk.sequence_kept is not None:
            rows = np.concatenate([u.targets.trajectory for u in batch_units])  # [C]
            kept = walk.sequence_kept[torch.as_tensor(rows, device=walk.sequence_kept.device)]
        weight = correction_weights(lcfg, old, given.old_logprob, kept)
        terms = objective(lcfg, logp, contrib, entropy=graph.entropy, ref_logprob=ref, pg_weight=weight)
        total = terms.loss if self.shards is None else terms.loss * self.shards.loss_share
        if self.cfg.contract == "exact":
            total = self._close(walk, graph, total)
        return terms, total

    # ----- step 3: close ----------------------------------------------------------------------------
    def _close(self, walk: TreeWalk, graph: StepGraph, total: torch.Tensor) -> torch.Tensor:
        """`total` plus <KV_unit, G_unit> for each of the graph's units with children: its backward pushes
        the gradient the unit's descendants deposited on its KV (G) through the unit's own recompute."""
        for row, unit in enumerate(graph.units):
            grad = self.store.grad(walk.paths.key(unit.index), self.identity) if unit.children else None
            if grad is None:
                continue
            for new, g in zip(own_kv(unit, graph.out, row), grad):
                for t, gt in zip(grad_tensors(new), entry_tensors(g)):
                    # A G part on `meta` is held by another rank of the context group: a zero term here keeps
                    # this rank's backward through the same attention layers (their collectives match).
                    total = total + (t.sum() * 0.0 if gt.is_meta else (t * gt).sum())
        return total

    def _old_logprobs(
        self,
        contrib: Contributions,
        batch_units: Sequence[Unit],
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
