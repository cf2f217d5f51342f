"""Tree replay: the RL loss over a tree, with each shared unit evaluated once (DESIGN.md, core algorithm).

For one tree:
1. Scoring (no graph): old logprobs when the ratio uses them, reference logprobs when KL is on, and the
   resident KV of internal units. Without a scoring pass, KV is computed lazily when first needed.
2. The schedule's steps, post-order: K sibling units run under autograd against their parent's resident
   path. In `exact` mode the path KV enters as leaf tensors, so backward deposits dL/dKV on every ancestor
   (accumulated as G in the store). A unit with children adds <KV_unit, G_unit> to its loss, which pushes
   its descendants' gradient through its own recompute. `response_only` reads the path KV detached and
   adds no such term.
3. A unit's KV and G are released right after its own step.

Normalization comes from the manifest through the target coefficients; how units are batched or ordered
only changes the summation order.

Example:
    >>> engine = TreeReplay(model, LossConfig(), ReplayConfig(contract="exact", microbatch=2))  # doctest: +SKIP
    >>> report = engine.accumulate(UpdateBatch.build(trees, advantages, manifest))           # doctest: +SKIP
    >>> report.loss                                                                            # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from treetrain.engine.batch import ReplayConfig, ReplayReport, TreeWork, UpdateBatch
from treetrain.engine.pieces import forward_units, gather_targets, own_kv, target_stats
from treetrain.engine.resident import ResidentIdentity, ResidentStore
from treetrain.engine.schedule import ReplayStep, active_units, build_schedule
from treetrain.engine.scoring import PathKV, past_before_overlap, scoring_pass
from treetrain.engine.units import UnitTree
from treetrain.loss.config import LossConfig
from treetrain.loss.objective import Contributions, objective
from treetrain.models.decoder import LayerKV
from treetrain.models.support import check_supported

Backward = Callable[[torch.Tensor], None]


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
        ref_model: PreTrainedModel | None = None,
        identity: ResidentIdentity | None = None,
        store: ResidentStore | None = None,
        backward: Backward = _default_backward,
        check_model: bool = True,
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
        self.check_model = check_model
        self.device = next(model.parameters()).device
        self.step_hook: Callable[[str, ReplayStep], None] | None = None
        """Called with ("forward" | "backward", step) before each phase; tests inject faults through it."""

    # ----- public -----------------------------------------------------------------------------------
    def accumulate(self, batch: UpdateBatch) -> ReplayReport:
        """Run every tree of the batch; parameter `.grad`s accumulate the update's gradient."""
        if self.check_model:
            longest = max((t.tree.stats().max_sequence_length for t in batch.work), default=0)
            check_supported(self.model, longest)
            self.check_model = False
        report = ReplayReport()
        for work in batch.work:
            report = report.merged(self._tree(work))
        return report

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

        old_lp: Sequence[torch.Tensor | None] = [None] * len(units)
        if lcfg.ratio_source == "scoring":
            scored = [u.targets.num_targets > 0 or needs_kv[u.index] for u in units.units]
            old_lp, n_tok = scoring_pass(
                self.model, paths, microbatch=cfg.score_microbatch, need=scored,
                keep=lambda u: needs_kv[u], max_logit_elements=cfg.max_logit_elements,
            )  # fmt: skip
            report = report.merged(ReplayReport(nograd_tokens=n_tok))
        ref_lp: Sequence[torch.Tensor | None] = [None] * len(units)
        if lcfg.needs_reference:
            ref_lp, n_tok = self._reference_logprobs(units)
            report = report.merged(ReplayReport(nograd_tokens=n_tok))

        try:
            for step in steps:
                report = report.merged(self._run_step(units, paths, step, old_lp, ref_lp))
        finally:
            for u in range(len(units)):
                self.store.release(paths.key(u))
        return report.merged(
            ReplayReport(nograd_tokens=paths.recomputed_tokens, recomputed_units=paths.recomputed_units)
        )

    @staticmethod
    def _needs_kv(units: UnitTree, steps: Sequence[ReplayStep]) -> list[bool]:
        need = [False] * len(units)
        for s in steps:
            for u in units.path(s.parent):
                need[u] = True
        return need

    def _reference_logprobs(self, units: UnitTree) -> tuple[list[torch.Tensor | None], int]:
        assert self.ref_model is not None
        ref_identity = ResidentIdentity.of(self.ref_model, tokenizer=self.identity.tokenizer)
        store = ResidentStore(ref_identity)
        paths = PathKV(self.ref_model, units, store, ref_identity, self.device)
        need = [u.targets.num_targets > 0 for u in units.units]
        for u in reversed(units.units):
            if need[u.index] and u.parent is not None:
                need[u.parent] = True
        lps, n_tok = scoring_pass(
            self.ref_model, paths, microbatch=self.cfg.score_microbatch, need=need, keep=lambda u: False,
            max_logit_elements=self.cfg.max_logit_elements,
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

    def _step(
        self,
        units: UnitTree,
        paths: PathKV,
        step: ReplayStep,
        old_lp: Sequence[torch.Tensor | None],
        ref_lp: Sequence[torch.Tensor | None],
    ) -> ReplayReport:
        exact = self.cfg.contract == "exact"
        lcfg = self.loss_cfg
        batch_units = [units[u] for u in step.units]
        path = units.path(step.parent)
        pieces = paths.pieces(step.parent) if path else []
        leaves: list[list[LayerKV]] = []
        if exact:
            leaves = [
                [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in p] for p in pieces
            ]
            past = past_before_overlap(leaves)
        else:
            past = past_before_overlap(pieces)

        if self.step_hook is not None:
            self.step_hook("forward", step)
        padded, out = forward_units(self.model, batch_units, past, self.device)
        gathered = gather_targets([u.targets for u in batch_units], padded.input_ids.shape[1], self.device)
        logp, entropy = target_stats(
            self.model, out.hidden, gathered, with_entropy=lcfg.needs_entropy,
            max_logit_elements=self.cfg.max_logit_elements,
        )  # fmt: skip
        old = self._old_logprobs(gathered.contributions, batch_units, old_lp, logp)
        ref = self._cat([ref_lp[u.index] for u in batch_units], logp) if lcfg.needs_reference else None
        contrib = Contributions(
            gathered.contributions.target, gathered.contributions.coef, gathered.contributions.advantage, old
        )
        terms = objective(lcfg, logp, contrib, entropy=entropy, ref_logprob=ref)
        total = terms.loss
        if exact:
            for row, unit in enumerate(batch_units):
                grad = self.store.grad(paths.key(unit.index), self.identity) if unit.children else None
                if grad is None:
                    continue
                for (k_new, v_new), (gk, gv) in zip(own_kv(unit, out, row), grad):
                    total = total + (k_new * gk).sum() + (v_new * gv).sum()

        if self.step_hook is not None:
            self.step_hook("backward", step)
        try:
            if total.requires_grad:
                self.backward(total)
        except Exception as exc:
            raise BackwardFailed(f"backward of step {step} failed; the update window must be reset") from exc
        if exact:
            for unit_index, piece in zip(path, leaves):
                grads = [(k.grad, v.grad) for k, v in piece]
                if all(gk is not None and gv is not None for gk, gv in grads):
                    self.store.add_grad(paths.key(unit_index), grads, self.identity)  # type: ignore[arg-type]
        for unit in batch_units:
            self.store.release(paths.key(unit.index))
        return ReplayReport(
            loss=float(terms.loss.detach()),
            pg=terms.pg,
            kl=terms.kl,
            entropy=terms.entropy,
            clipped=terms.clipped,
            graph_tokens=sum(padded.lengths),
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
            if torch.isnan(contrib.old_logprob).any():
                raise ValueError(
                    "loss.ratio_source is 'sampler' but some policy tokens have no sampler logprobs; "
                    "record them at rollout or use ratio_source='scoring'"
                )
            return contrib.old_logprob
        per_target = self._cat([old_lp[u.index] for u in batch_units], logp)
        return per_target[contrib.target]

    @staticmethod
    def _cat(parts: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        tensors = [p for p in parts if p is not None]
        if not tensors:
            return like.new_zeros(0)
        return torch.cat(tensors).to(like.dtype)
