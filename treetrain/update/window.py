"""The update window: one optimizer step whose manifest is covered exactly once, on any number of ranks.

    window = UpdateWindow(backend, LossConfig())
    report = window.run(groups, plan=ReplayConfig())     # open -> replay_all -> commit

`treetrain.update.run.run_update` drives it for the trainer, one step at a time. `open` takes the
manifest and batch built once for the update (or builds them) and the placement, and all ranks agree on
the resident identity (model version included), the manifest digest and the placement digest before any
compute. The planner's `ReplayRecipe` is then laid out over this rank's trees as an immutable
`ReplayPlan` (each tree's steps, kept graphs and evictions), and a replayer (`TreeReplay`, or the flat
reference `FlatReference`) is built to carry it out. `replay(tree_id)` runs one tree's share on this rank
through it, claiming its `ContributionKey`s in `CoverageClaims` first, so a duplicate request is refused
instead of counted twice. Faults (only the transient kinds, see `treetrain.update.faults.is_transient`:
`RuntimeError` including out-of-memory and `BackwardFailed`, and `OSError`):

- an error that will not go away on a retry (`ValueError`, `TypeError`, `IndexError`, `KeyError`,
  `StaleResidentStateError`, `ManifestError`, `UnsupportedModelError`, `BudgetTooSmallError`, any
  non-transient kind): a bug or bad input, re-raised at once on that rank, without retry and without
  dropping anything; this rank's gradients are discarded first if a backward of the tree ran;
- an exception before the tree's first backward: nothing was accumulated, so the tree is retried
  (`WindowConfig.tree_attempts`); an out-of-memory error inside a step was already split by the replay;
- an exception once a backward ran (`BackwardFailed`, or a failure later in the same tree): this rank's
  gradients hold part of a tree, so the backend window is reset and every tree of this rank is replayed;
  after an out-of-memory error there, with a plan laid out again for half the widest step's rows, by a
  fresh replayer;
- a tree that keeps failing marks its group failed. At `commit` the ranks exchange failed groups; any
  failure drops the group whole on every rank, with its reason logged: the manifest is rebuilt without
  it (so normalization excludes it), every rank resets and replays, and the group is never trained on
  in part.

`commit` is `settle` (replay anything still missing, drop failed groups), `check` (collectively: the
identity, the manifest digest and the coverage, every key exactly once over all ranks) and `step` (the
backend's optimizer step, then the next model version). Afterwards the
model version is bumped and resident state invalidated: reading it again raises
`StaleResidentStateError`. The version counts committed windows, so it is bumped also when the backend
skipped the update (`WindowReport.step_applied` is False: DeepSpeed may skip a step on overflow): the weights did
not change then, and throwing resident state away is merely wasteful, never wrong; every window's
contribution keys stay distinct.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from treetrain.distributed.backend import TrainBackend
from treetrain.distributed.coverage import (
    CoverageClaims,
    check_coverage,
    decode_keys,
    encode_keys,
    explain_mismatch,
)
from treetrain.distributed.placement import Placement, place
from treetrain.loss.loss_config import LossConfig
from treetrain.loss.manifest import ContributionKey, ManifestError
from treetrain.loss.sampler_correction import SamplerGap
from treetrain.memory.replay_recipe import ReplayRecipe
from treetrain.models.lora import Reference
from treetrain.models.support import SupportGate
from treetrain.replay import (
    BackwardFailed,
    FlatReference,
    ReplayConfig,
    ReplayPlan,
    ReplayReport,
    TreeReplay,
    UpdateBatch,
)
from treetrain.replay.batch import TreeWork
from treetrain.replay.replay_plan import ReplayHooks
from treetrain.replay.resident import ResidentIdentity, ResidentStore
from treetrain.update.faults import is_transient
from treetrain.update.window_types import DroppedGroup, Group, WindowConfig, WindowReport

log = logging.getLogger("treetrain.update")


class UpdateWindow:
    """Runs update windows over a backend, one optimizer step each (see module docstring).

    `store` holds resident state under its identity (model version, adapters, tokenizer, dtype, ...); a
    fresh one at version 0 if omitted. The window owns it from then on: each commit bumps the identity and
    invalidates the store. `plan` is how windows replay unless `open` is given one. `hooks` go to every
    replayer the window builds (tests inject faults through them).
    """

    def __init__(
        self,
        backend: TrainBackend,
        loss: LossConfig,
        plan: ReplayRecipe | ReplayPlan | ReplayConfig | None = None,
        cfg: WindowConfig | None = None,
        *,
        store: ResidentStore | None = None,
        ref_model: Reference | None = None,
        hooks: ReplayHooks | None = None,
    ) -> None:
        self.backend = backend
        self.loss = loss
        self.plan = ReplayRecipe.of(plan)
        self.cfg = cfg or WindowConfig()
        self.ref_model = ref_model
        self.store = store if store is not None else ResidentStore(ResidentIdentity.of(backend.module))
        self.store.exchange = backend.context  # a context group shares each tree's resident state
        self.hooks = hooks or ReplayHooks()
        self.support = SupportGate()
        """Remembers which models and lengths tree replay has already checked."""
        self.active: OpenWindow | None = None
        """The window between `open` and `commit`, if any (step hooks read `active.current_tree`)."""

    @property
    def identity(self) -> ResidentIdentity:
        """The resident identity of the current version (the store's)."""
        return self.store.identity

    @property
    def version(self) -> int:
        """The model version: how many windows were committed, including any whose step the backend
        skipped (see the module docstring); equal to the last `WindowReport.version`."""
        return self.identity.model_version

    def open(
        self,
        groups: Sequence[Group],
        placement: Placement | None = None,
        *,
        plan: ReplayRecipe | ReplayPlan | ReplayConfig | None = None,
        batch: UpdateBatch | None = None,
    ) -> OpenWindow:
        """Open the window over `groups`. `batch` is the whole update's batch when the caller already built
        it (for the planner) at this version; otherwise it is built here."""
        if batch is not None and batch.manifest.version != self.version:
            raise ManifestError(
                f"the batch is for version {batch.manifest.version}, the window is at {self.version}"
            )
        self.active = OpenWindow(
            self, groups, placement, ReplayRecipe.of(plan) if plan is not None else self.plan, batch
        )
        return self.active

    def run(
        self,
        groups: Sequence[Group],
        placement: Placement | None = None,
        *,
        plan: ReplayRecipe | ReplayPlan | ReplayConfig | None = None,
    ) -> WindowReport:
        """Open, replay and commit one window (`treetrain.update.run.run_update` spells the steps out)."""
        window = self.open(groups, placement, plan=plan)
        window.replay_all()
        return window.commit()

    def advance(self) -> None:
        """After a commit (applied or skipped step): a new model version; all resident state is stale."""
        self.store.invalidate(self.identity.bumped())


@dataclass
class _Counters:
    tree_retries: int = 0
    window_resets: int = 0
    resets_by_group: dict[int, int] = field(default_factory=dict)


class OpenWindow:
    """One update window between `UpdateWindow.open` and `commit`."""

    def __init__(
        self,
        owner: UpdateWindow,
        groups: Sequence[Group],
        placement: Placement | None,
        recipe: ReplayRecipe,
        batch: UpdateBatch | None,
    ) -> None:
        self.owner = owner
        self.backend = owner.backend
        self.recipe = recipe
        """The planner's decision for the update; laid out over this rank's trees as `plan`."""
        self.groups = tuple(groups)
        self.alive = set(range(len(self.groups)))
        self.dropped: list[DroppedGroup] = []
        self.failures: dict[int, str] = {}
        self.counters = _Counters()
        self.local = ReplayReport()
        self.closed = False
        self.current_tree: str | None = None
        """The tree being replayed right now (for logs and fault-injection hooks)."""
        self.backward_calls = 0
        """Backward calls issued by this window; tells a failure before backward from one after."""
        self._given_placement = placement
        self.group_of: dict[str, int] = {}
        for gi, g in enumerate(self.groups):
            if len(g.trees) != len(g.advantages):
                raise ValueError(f"group {gi}: {len(g.trees)} trees but {len(g.advantages)} advantage tables")
            for t in g.trees:
                if t.id in self.group_of:
                    raise ManifestError(
                        f"tree {t.id[:12]} appears twice in the update (groups {self.group_of[t.id]}, {gi})"
                    )
                self.group_of[t.id] = gi
        self.backend.agree(
            repr(owner.identity), "resident identity (model version, adapter, tokenizer, dtype, ...)"
        )
        self._build(batch)
        self.backend.begin_window()
        self._lay_out()

    # ----- manifest, placement, local share ---------------------------------------------------------
    def _build(self, whole: UpdateBatch | None = None) -> None:
        """The manifest, the placement and this rank's share, over the groups still alive. `whole` is the
        update's batch as the caller built it; after a group is dropped it is built again without it."""
        alive = sorted(self.alive)
        if not alive:
            reasons = "; ".join(f"group {d.index}: {d.reason}" for d in self.dropped)
            raise ManifestError(f"every group of the update was dropped, nothing to train on ({reasons})")
        trees = [t for gi in alive for t in self.groups[gi].trees]
        if whole is None:
            advantages = [a for gi in alive for a in self.groups[gi].advantages]
            whole = UpdateBatch.build(trees, advantages, self.owner.loss, version=self.owner.version)
        self.manifest = whole.manifest
        ws, ctx = self.backend.world_size, self.backend.context_size
        given = self._given_placement  # over data-parallel groups: a context group replays the same trees
        self.placement = place(trees, ws // ctx) if given is None else given.restricted_to(trees)
        if self.placement.world_size != ws // ctx:
            raise ValueError(
                f"placement is for {self.placement.world_size} ranks, the backend has {ws // ctx} data groups"
            )
        self.backend.agree(self.manifest.digest, "manifest digest")
        self.backend.agree(self.placement.digest, "placement")
        mine = self.placement.for_rank(self.backend.rank // ctx)
        batch = whole.restricted(dict(zip(self.placement.tree_ids, mine)))
        self.local_batch = batch
        """This rank's share of the update."""
        self.work: dict[str, TreeWork] = {w.tree.id: w for w in batch.work}
        self.claims = CoverageClaims(k for w in batch.work for k in self.keys(w))

    def keys(self, work: TreeWork) -> tuple[ContributionKey, ...]:
        return work.contribution_keys(self.owner.version)

    def _lay_out(self) -> None:
        """This rank's immutable plan from the recipe, and a fresh replayer to carry it out."""
        o = self.owner
        self.plan = self.recipe.lay_out(self.local_batch, self.backend.module, o.loss, o.ref_model).plan
        """This rank's plan: mode, K, chunking, and per tree its steps, kept graphs and evictions."""
        self.replayer = self._replayer()

    def _replayer(self) -> TreeReplay | FlatReference:
        o, plan = self.owner, self.plan
        if plan.mode == "flat":
            flat = ReplayConfig(
                microbatch=max(1, plan.config.microbatch), max_logit_elements=plan.config.max_logit_elements
            )
            share = 1.0 / self.backend.context_size  # a context group's ranks replay the same calls

            def backward(loss: torch.Tensor) -> None:
                self._backward(loss if share == 1.0 else loss * share)

            return FlatReference(self.backend.module, o.loss, flat, ref_model=o.ref_model, backward=backward)
        return TreeReplay(
            self.backend.module, o.loss, plan, ref_model=o.ref_model, store=o.store, support=o.support,
            hooks=dataclasses.replace(o.hooks, backward=self._backward),
        )  # fmt: skip

    def _backward(self, loss: torch.Tensor) -> None:
        self.backward_calls += 1
        self.backend.backward(loss)

    # ----- local replay -----------------------------------------------------------------------------
    def replay(self, tree_id: str) -> None:
        """Replay this rank's share of one tree; a tree already covered (or in flight) is refused."""
        if self.closed:
            raise RuntimeError("this update window is already committed")
        work = self.work.get(tree_id)
        if work is None:
            raise ManifestError(
                f"tree {tree_id[:12]} has no contributions on rank {self.backend.rank} in this window"
            )
        group = self.group_of[tree_id]
        keys = self.keys(work)
        self.claims.claim(keys)
        if group in self.failures:
            self.claims.release(keys)
            return
        self.current_tree = tree_id
        attempts = self.owner.cfg.tree_attempts
        for attempt in range(attempts):
            if attempt:
                self.counters.tree_retries += 1
                self.claims.claim(keys)
            before = self.backward_calls
            try:
                report = self.replayer.accumulate(UpdateBatch((work,), self.manifest))
            except Exception as exc:
                self.owner.store.clear()
                self.claims.release(keys)
                if not is_transient(exc):
                    if self.backward_calls != before:
                        self._discard()
                    raise
                where = f"{type(exc).__name__} in tree {tree_id[:12]}"
                if isinstance(exc, BackwardFailed) or self.backward_calls != before:
                    self._reset(group, f"{where} after a backward of it ran: {exc}")
                    self._narrow_after_oom(exc)
                    return
                log.warning("rank %d: %s before any backward (%s)", self.backend.rank, where, exc)
                if attempt + 1 == attempts:
                    self._fail(group, f"tree {tree_id[:12]} failed {attempts} times before backward: {exc!r}")
                continue
            self.claims.commit(keys)
            self.local = self.local.merged(report)
            return

    def replay_all(self) -> None:
        """Replay every contribution of this rank that is not covered yet (after a reset: all of them)."""
        while pending := [tid for tid in self.work if self._due(tid)]:
            for tid in pending:
                if self._due(tid):  # a failure or a reset during this pass changes what is due
                    self.replay(tid)

    def _due(self, tid: str) -> bool:
        """The tree still has contributions to replay: its group has not failed and they are not covered."""
        return self.group_of[tid] not in self.failures and not self.claims.is_covered(
            self.keys(self.work[tid])
        )

    def _discard(self) -> None:
        """Forget this rank's gradients and coverage (local; the trees are replayed again if needed)."""
        self.backend.reset_window()
        self.claims.reset()
        self.local = ReplayReport()

    def _reset(self, group: int, reason: str) -> None:
        self._discard()
        self.counters.window_resets += 1
        n = self.counters.resets_by_group.get(group, 0) + 1
        self.counters.resets_by_group[group] = n
        log.warning("rank %d: update window reset (%s); replaying it", self.backend.rank, reason)
        if n >= self.owner.cfg.window_attempts:
            self._fail(group, f"backward failed {n} times; last: {reason}")

    def _narrow_after_oom(self, exc: BaseException) -> None:
        """After an out-of-memory error in backward, replay with half as many sibling rows per step (K): the
        recipe narrowed, laid out again, and a fresh replayer.

        A split before backward happens inside the replay; once backward has started only a window reset
        can undo the step, and the same K would most likely run out of memory again.
        """
        cause = exc.__cause__ if isinstance(exc, BackwardFailed) else exc
        replayer = self.replayer
        if not isinstance(cause, torch.OutOfMemoryError) or not isinstance(replayer, TreeReplay):
            return
        widest = replayer.widest_step
        if widest > 1:
            k = widest // 2
            log.warning("rank %d: replaying with K = %d after running out of memory", self.backend.rank, k)
            self.recipe = self.recipe.narrower(k)
            self._lay_out()

    def _fail(self, group: int, reason: str) -> None:
        self.failures[group] = reason
        log.error("rank %d: group %d cannot be completed: %s", self.backend.rank, group, reason)

    # ----- the step ---------------------------------------------------------------------------------
    def _exchange_failures(self) -> dict[int, str]:
        per_rank = self.backend.gather(json.dumps(sorted(self.failures.items())))
        failed: dict[int, str] = {}
        for rank, text in enumerate(per_rank):
            for gi, reason in json.loads(text):
                failed.setdefault(int(gi), f"rank {rank}: {reason}")
        return failed

    def commit(self) -> WindowReport:
        """The window's last three steps: `settle`, `check`, `step`."""
        self.settle()
        self.check()
        return self.step()

    def settle(self) -> None:
        """Replay what is missing; a group that failed on any rank is dropped whole on every rank, and the
        manifest is rebuilt without it (so normalization excludes it) and everything replayed again."""
        if self.closed:
            raise RuntimeError("this update window is already committed")
        for _ in range(len(self.groups) + 1):
            self.replay_all()
            failed = self._exchange_failures()
            if not failed:
                return
            for gi, reason in sorted(failed.items()):
                tree_ids = tuple(t.id for t in self.groups[gi].trees)
                self.dropped.append(DroppedGroup(gi, tree_ids, reason))
                self.alive.discard(gi)
                log.error(
                    "group %d (trees %s) dropped from the update: %s", gi, [t[:12] for t in tree_ids], reason
                )
            self.failures.clear()
            self.backend.reset_window()
            self.owner.store.clear()
            self._build()
            self._lay_out()
            self.local = ReplayReport()

    def step(self) -> WindowReport:
        """The optimizer step (after `check`), then the next model version: resident state of this one
        becomes unreadable."""
        if self.closed:
            raise RuntimeError("this update window is already committed")
        gap = SamplerGap()  # collective, like the step: every rank's gap, summed
        for text in self.backend.gather(self.local.sampler_gap.encode()):
            gap = gap.merged(SamplerGap.decode(text))
        applied = self.backend.step()
        self.closed = True
        self.current_tree = None
        self.owner.active = None
        self.owner.advance()
        return WindowReport(
            self.owner.version, self.manifest.digest, len(self.manifest.keys()), self.local,
            self.counters.tree_retries, self.counters.window_resets, tuple(self.dropped), applied,
            self.placement.rank_tokens, gap,
        )  # fmt: skip

    def check(self) -> None:
        """Collective: same identity and manifest everywhere, and every manifest key covered exactly once."""
        self.backend.agree(
            repr(self.owner.identity), "resident identity (model version, adapter, tokenizer, dtype, ...)"
        )
        self.backend.agree(self.manifest.digest, "manifest digest")
        expected = self.manifest.keys()
        if check_coverage(self._group_leads(self.backend.gather(self.claims.summary().encode())), expected):
            return
        per_rank = [
            decode_keys(t) for t in self._group_leads(self.backend.gather(encode_keys(self.claims.covered)))
        ]
        raise ManifestError(
            f"coverage check failed, the optimizer step is refused: {explain_mismatch(per_rank, expected)}"
        )

    def _group_leads(self, per_rank: list[str]) -> list[str]:
        """The first rank's entry of each context group, after checking that the group's other ranks, which
        replay the same trees in lockstep, covered the same contributions."""
        ctx = self.backend.context_size
        odd = [r for r, text in enumerate(per_rank) if text != per_rank[r - r % ctx]]
        if odd:
            raise ManifestError(
                f"coverage check failed, the optimizer step is refused: ranks {odd} covered other contributions "
                "than the first rank of their context group"
            )
        return per_rank[::ctx]
