"""The conventional reference (`flat`): every call run in full, forward and backward, per microbatch.

This is the oracle of every differential test and a selectable mode: what a conventional trainer does
with the same loss, the same normalization and the same loss inputs. It shares the model code
(`decoder_forward`), the logprob code and the objective with the tree engine, and nothing else.

Like the tree engine, it scores every call (no graph) before the first backward, microbatch by microbatch:
the sampler correction's `sequence_mask` needs a trajectory's every token before any of its terms, and a
trajectory of several calls spans microbatches. Only the `[M]` old logprobs of each call are kept.

Example:
    >>> flat = FlatReference(model, LossConfig(), ReplayConfig(microbatch=2))   # doctest: +SKIP
    >>> flat.accumulate(batch).loss                                    # doctest: +SKIP
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from treetrain.loss.loss_config import LossConfig
from treetrain.loss.objective import Contributions, objective, sampler_logprobs
from treetrain.loss.sampler_correction import correction_weights, sampler_terms
from treetrain.loss.targets import TargetTable, call_target_counts, call_targets
from treetrain.models.decoder import decoder_forward
from treetrain.models.lora import Reference, adapters_disabled
from treetrain.replay.batch import ReplayConfig, ReplayReport, UpdateBatch
from treetrain.replay.pieces import GatheredTargets, gather_targets, pad_pieces, target_stats
from treetrain.tree.trajectory_tree import CallRef


@dataclass(frozen=True)
class FlatCall:
    tokens: tuple[int, ...]
    targets: TargetTable
    sequence: int = 0
    """Which trajectory of the batch the call belongs to (numbered in `calls`): `sequence_mask`'s unit."""


@dataclass(frozen=True)
class FlatCallSize:
    """What the planner needs of a `FlatCall`: its length and its number of targets."""

    tokens: int
    targets: int


_C = TypeVar("_C", FlatCall, FlatCallSize)


ONE_CALL = ReplayConfig(microbatch=1)
"""The flat reference's default: one call per forward and backward, in tree order."""


class FlatReference:
    """Per-call full-sequence forward and backward with the tree engine's loss."""

    def __init__(
        self,
        model: PreTrainedModel,
        loss: LossConfig,
        replay: ReplayConfig = ONE_CALL,
        *,
        ref_model: Reference | None = None,
        backward: Callable[[torch.Tensor], None] = lambda t: t.backward(),
    ) -> None:
        """`replay` is the engines' one vocabulary; flat reads its `microbatch` (calls per forward and
        backward, at least 1), `order` and `seed` (the call order) and `max_logit_elements`."""
        if loss.needs_reference and ref_model is None:
            raise ValueError("loss.kl_coef > 0 needs a reference model")
        if replay.microbatch < 1:
            raise ValueError(f"flat microbatch must be >= 1, got {replay.microbatch}")
        self.model = model
        self.ref_model = ref_model
        self.loss_cfg = loss
        self.microbatch = replay.microbatch
        self.order = replay.order
        self.seed = replay.seed
        self.backward = backward
        self.max_logit_elements = replay.max_logit_elements
        self.device = next(model.parameters()).device

    def calls(self, batch: UpdateBatch) -> list[FlatCall]:
        out = []
        sequence = 0
        for work in batch.work:
            for t in sorted(work.trajectories):
                traj = work.tree.trajectory(t)  # once per trajectory, not once per call
                for c in range(len(traj.calls)):
                    ref = CallRef(t, c)
                    table = call_targets(work.tree, ref, work.advantages, batch.manifest, self.loss_cfg, traj)
                    if table.num_targets:
                        out.append(FlatCall(traj.calls[c].tokens, table, sequence))
                sequence += 1
        return self._ordered(out)

    def call_sizes(self, batch: UpdateBatch) -> list[FlatCallSize]:
        """The length and target count of each call `calls` gives, in the same order, read off the tree:
        the work is the tree's (node, trajectory) pairs, nodes and calls, never the calls' lengths, which
        shared prefixes make far larger than the file (the planner prices flat mode with these)."""
        out = []
        for work in batch.work:
            counts = call_target_counts(work.tree, batch.manifest, self.loss_cfg)
            for t in sorted(work.trajectories):
                for c, record in enumerate(work.tree.records[t].calls):
                    if counts[CallRef(t, c)]:
                        out.append(FlatCallSize(work.tree.nodes[record.end].end, counts[CallRef(t, c)]))
        return self._ordered(out)

    def _ordered(self, out: list[_C]) -> list[_C]:
        if self.order == "reverse":
            out.reverse()
        elif self.order == "shuffle":
            random.Random(self.seed).shuffle(out)
        return out

    def accumulate(self, batch: UpdateBatch) -> ReplayReport:
        calls = self.calls(batch)
        old, report, kept = self._score(calls)
        for i in range(0, len(calls), self.microbatch):
            j = i + self.microbatch
            report = report.merged(
                self._microbatch(
                    calls[i:j], old[i:j] if old is not None else None, kept[i:j] if kept is not None else None
                )
            )
        return report

    def _score(
        self, calls: Sequence[FlatCall]
    ) -> tuple[list[torch.Tensor] | None, ReplayReport, torch.Tensor | None]:
        """Each call's old logprobs `[M_i]` (no graph), the tokens run and the sampler gap, and under
        `sequence_mask` each call's verdict `[calls]`; nothing without a scoring pass (`ratio_source='sampler'`)."""
        if self.loss_cfg.ratio_source != "scoring":
            return None, ReplayReport(), None
        old: list[torch.Tensor] = []
        tokens = 0
        with torch.no_grad():
            for i in range(0, len(calls), self.microbatch):
                part = calls[i : i + self.microbatch]
                logp, _, gathered, n = self._forward(self.model, part, False)
                tokens += n
                offsets = gathered.target_offsets
                old.extend(logp[offsets[r] : offsets[r + 1]].detach() for r in range(len(part)))
        sequence = [torch.full((len(c.targets.contrib_target),), c.sequence, dtype=torch.long) for c in calls]
        sequences = max((c.sequence for c in calls), default=-1) + 1
        terms = sampler_terms(self.loss_cfg, [c.targets for c in calls], old, sequence, sequences)
        kept = None
        if terms.kept is not None:
            kept = terms.kept[torch.as_tensor([c.sequence for c in calls], device=terms.kept.device)]
        return old, ReplayReport(nograd_tokens=tokens, sampler_gap=terms.gap), kept

    def _forward(
        self, model: PreTrainedModel, calls: Sequence[FlatCall], with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, GatheredTargets, int]:
        padded = pad_pieces([c.tokens for c in calls], [0] * len(calls), self.device)
        out = decoder_forward(model, padded.input_ids, padded.positions, None)
        gathered = gather_targets([c.targets for c in calls], padded.input_ids.shape[1], self.device)
        logp, ent = target_stats(
            model,
            out.hidden,
            gathered,
            with_entropy=with_entropy,
            max_logit_elements=self.max_logit_elements,
            temperature=self.loss_cfg.logit_temperature,
        )
        return logp, ent, gathered, sum(padded.lengths)

    def _microbatch(
        self,
        calls: Sequence[FlatCall],
        scored: Sequence[torch.Tensor] | None,
        kept: torch.Tensor | None,  # [calls] bool
    ) -> ReplayReport:
        lcfg = self.loss_cfg
        nograd = 0
        old_per_target = torch.cat(list(scored)) if scored is not None else None  # [M]
        ref = None
        if lcfg.needs_reference:
            assert self.ref_model is not None
            with torch.no_grad(), adapters_disabled(self.ref_model) as ref_model:
                ref, _, _, n = self._forward(ref_model, calls, False)
            nograd += n
        logp, ent, gathered, n_graph = self._forward(self.model, calls, lcfg.needs_entropy)
        c = gathered.contributions
        old = old_per_target.to(logp.dtype)[c.target] if old_per_target is not None else sampler_logprobs(c)
        rows = None
        if kept is not None:  # [C]: each contribution's call's verdict
            counts = torch.as_tensor([len(call.targets.contrib_target) for call in calls], device=kept.device)
            rows = kept.repeat_interleave(counts)
        weight = correction_weights(lcfg, old, c.old_logprob, rows)
        terms = objective(
            lcfg, logp, Contributions(c.target, c.coef, c.advantage, old), entropy=ent, ref_logprob=ref,
            pg_weight=weight,
        )  # fmt: skip
        self.backward(terms.loss)
        return ReplayReport(
            loss=float(terms.loss.detach()),
            pg=terms.pg,
            kl=terms.kl,
            entropy=terms.entropy,
            clipped=terms.clipped,
            graph_tokens=n_graph,
            nograd_tokens=nograd,
            steps=1,
        )
