"""One tree's replay state: its units, post-order schedule, resident paths, logprobs and kept graphs.

`TreeWalk.build` derives everything about a tree that does not need the model: the units (nodes split into
chunks), the schedule of replay steps, which units' KV some step reads and which units the scoring pass
evaluates. Which internal units keep their first graph is the plan's (`TreeSchedule.kept`), checked against
the walk. `TreeReplay` then fills in the logprobs and the graphs as it walks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from treetrain.loss.loss_config import LossConfig
from treetrain.loss.sampler_correction import SamplerGap, sampler_terms
from treetrain.models.decoder import DecoderOutput
from treetrain.replay.batch import ReplayConfig, TreeWork
from treetrain.replay.pieces import GatheredTargets, PieceBatch
from treetrain.replay.replay_schedule import TreeSchedule
from treetrain.replay.schedule import ReplayStep, active_units, build_schedule
from treetrain.replay.scoring import PathKV, ReferenceWalk
from treetrain.replay.units import Unit, UnitTree


@dataclass
class StepGraph:
    """A forward under autograd of sibling units against their parent path's resident KV."""

    units: list[Unit]
    path: tuple[int, ...]
    padded: PieceBatch
    out: DecoderOutput
    gathered: GatheredTargets
    logp: torch.Tensor  # [M]
    entropy: torch.Tensor | None  # [M]


@dataclass
class TreeWalk:
    """One tree's state while it is replayed."""

    units: UnitTree
    steps: tuple[ReplayStep, ...]
    needs_kv: list[bool]
    """Units whose KV some step reads (they are on a step's parent path)."""
    kept: frozenset[int]
    """Internal units whose first forward keeps its graph (the plan's `TreeSchedule.kept`)."""
    scored: list[bool]
    """Units the scoring pass evaluates: those with targets, and those whose KV is needed."""
    skipped: int
    """Units left out because nothing in their subtree carries gradient (`skip_inert`)."""
    paths: PathKV = field(init=False)
    """The tree's resident KV, recomputed on demand (set by the engine, which owns the store)."""
    reference: ReferenceWalk | None = None
    """The reference's half of a fused scoring walk, when there is one."""
    old_lp: list[torch.Tensor | None] = field(default_factory=list)
    """Old-policy logprobs of each unit's targets (`[M_u]`), from scoring or a kept graph's forward."""
    ref_lp: Sequence[torch.Tensor | None] = ()
    """Reference logprobs of each unit's targets, when KL is on."""
    graphs: dict[int, StepGraph] = field(default_factory=dict)
    """Kept units' first-forward graphs, until their own step consumes them."""
    sequence_kept: torch.Tensor | None = None  # [trajectories] bool
    """Under `loss.sampler_correction='sequence_mask'`: whether each trajectory's sequence ratio is within
    the cap (`treetrain.loss.sampler_correction`), set once the scoring pass is done."""

    @staticmethod
    def build(
        work: TreeWork, cfg: ReplayConfig, schedule: TreeSchedule | None, *, skip_inert: bool
    ) -> TreeWalk:
        """The walk of one tree under `cfg`; `skip_inert` leaves out branches that carry no gradient.
        `schedule` (None: nothing kept) must have been made for this walk (`TreeSchedule.check`)."""
        units = UnitTree.build(work.tree, work.targets, cfg.chunk_size)
        steps = build_schedule(
            units, contract=cfg.contract, microbatch=cfg.microbatch, order=cfg.order, seed=cfg.seed,
            skip_inert=skip_inert,
        )  # fmt: skip
        needs_kv = [False] * len(units)
        for s in steps:
            for u in units.path(s.parent):
                needs_kv[u] = True
        active = active_units(units, cfg.contract, skip_inert)
        kept: frozenset[int] = frozenset()
        if schedule is not None:
            keepable = frozenset(
                u.index for u in units.units[1:] if u.children and active[u.index] and cfg.contract == "exact"
            )
            schedule.check(steps, keepable)
            kept = schedule.kept
        scored = [u.targets.num_targets > 0 or needs_kv[u.index] for u in units.units]
        skipped = sum(1 for u in units.units[1:] if not active[u.index])
        return TreeWalk(units, steps, needs_kv, kept, scored, skipped, old_lp=[None] * len(units))

    def sampler_terms(self, lcfg: LossConfig, work: TreeWork) -> SamplerGap:
        """The sampler gap over the contributions of every scored target, once the scoring pass has run, and
        under `sequence_mask` each trajectory's verdict (`sequence_kept`), which needs all of its tokens
        before any of its terms is replayed. Nothing without a scoring pass: no trainer logprobs to compare.

        A branch skipped as inert (every advantage zero, no KL or entropy term: `ReplayConfig.skip_inert`)
        is not scored, so its tokens are not in the gap; `sequence_mask` never skips one
        (`LossConfig.zero_advantage_is_inert`), so every trajectory's ratio has all of its tokens."""
        if lcfg.ratio_source != "scoring":
            return SamplerGap()
        tables, old, missing = [], [], []
        for unit in self.units.units:
            lp = self.old_lp[unit.index]
            if unit.targets.num_targets and lp is None:
                missing.append(unit.index)
            elif unit.targets.num_targets and lp is not None:
                tables.append(unit.targets)
                old.append(lp)
        if missing and lcfg.sampler_correction == "sequence_mask":
            raise ValueError(f"units {missing} of tree {work.tree.id[:12]} were not scored")
        trajectory = [torch.as_tensor(t.trajectory) for t in tables]
        terms = sampler_terms(lcfg, tables, old, trajectory, len(work.tree.records))
        self.sequence_kept = terms.kept
        return terms.gap
