"""Step 5 of an update: replay this rank's share, and the one policy for what fails (retry, narrow, drop).

`replay_window` replays every tree of the window through a replayer built from the window's plan
(`Learner.replayer`), claiming each tree's `ContributionKey`s first, so a duplicate is refused instead of
counted twice. Only transient faults are retried (`is_transient`: `RuntimeError`, out-of-memory and
`BackwardFailed` included, and `OSError`):

- an error that will not go away on a retry (`ValueError`, `TypeError`, `IndexError`, `KeyError`,
  `StaleResidentStateError`, `ManifestError`, `UnsupportedModelError`, `BudgetTooSmallError`, any
  non-transient kind): a bug or bad input, re-raised at once on that rank, without retry and without
  dropping anything; this rank's gradients are discarded first if a backward of the tree ran;
- an exception before the tree's first backward: nothing was accumulated, so the tree is retried
  (`WindowConfig.tree_attempts`); an out-of-memory error inside a step was already split by the replayer;
- an exception once a backward ran (`BackwardFailed`, or a failure later in the same tree): this rank's
  gradients hold part of a tree, so they are discarded and every tree of this rank is replayed; after an
  out-of-memory error there, with the plan narrowed to half the widest step's rows, laid out again, by a
  fresh replayer (`WindowConfig.window_attempts` resets per group);
- a tree that keeps failing marks its group failed. Then the ranks exchange failed groups; any failure
  drops the group whole on every rank, with its reason logged: the window is opened again without it (so
  the manifest, and normalization, exclude it), every rank discards and replays, and the group is never
  trained on in part. With every group dropped, the update is refused (`ManifestError`).

In a context group (`distributed.context_parallel` > 1) nothing is retried: the group's ranks replay the
same steps in lockstep, each attention layer a collective of the group, so a rank that retried alone would
pair its collectives with the wrong ones of the others. The first failure stops this rank with
`LockstepFault` (one line naming the tree and the error); the others stop with it, and `--resume` redoes
the update.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import torch

from treetrain.errors import TreetrainError
from treetrain.loss.loss_config import LossConfig
from treetrain.loss.manifest import ManifestError
from treetrain.memory.retention import BudgetTooSmallError
from treetrain.models.support import UnsupportedModelError
from treetrain.replay import (
    BackwardFailed,
    FlatReference,
    ReplayReport,
    StaleResidentStateError,
    TreeReplay,
    UpdateBatch,
)
from treetrain.replay.protocols import MemoryProbe
from treetrain.update.learner import Learner
from treetrain.update.window import UpdateWindow, laid_out, open_window
from treetrain.update.window_types import DroppedGroup, Replayed

log = logging.getLogger("treetrain.update")

TRANSIENT: tuple[type[BaseException], ...] = (RuntimeError, OSError)
"""Faults a retry or a window reset can get past: out of memory (`torch.OutOfMemoryError` is a
`RuntimeError`), a failed backward (`BackwardFailed`), a collective or I/O error."""
PERMANENT: tuple[type[BaseException], ...] = (
    ValueError, TypeError, IndexError, KeyError, NotImplementedError, StaleResidentStateError,
    ManifestError, UnsupportedModelError, BudgetTooSmallError,
)  # fmt: skip
"""Bugs and bad input: a retry would fail the same way. Some are `RuntimeError`s, so this list wins."""


class LockstepFault(TreetrainError, RuntimeError):
    """A replay failure on a rank of a context group, which cannot retry alone (see the module docstring)."""


def is_transient(exc: BaseException) -> bool:
    """Whether a replay failure may be retried: a `TRANSIENT` kind that is not `PERMANENT`. A
    `BackwardFailed` is judged by the error that made backward fail.

    >>> is_transient(RuntimeError("CUDA error")), is_transient(ManifestError("bad")), is_transient(KeyError(1))
    (True, False, False)
    """
    cause = exc.__cause__ if isinstance(exc, BackwardFailed) and exc.__cause__ is not None else exc
    return isinstance(cause, TRANSIENT) and not isinstance(cause, PERMANENT)


def replay_window(
    learner: Learner, window: UpdateWindow, loss: LossConfig, tracker: MemoryProbe | None = None
) -> tuple[UpdateWindow, Replayed]:
    """Replay every contribution of this rank in `window`, retrying, narrowing and dropping as the module
    docstring says (collective: the ranks exchange failed groups). Returns the window the update ends with
    (without dropped groups, with a narrower plan after an out-of-memory error) and what the replay did."""
    run = _Replay(learner, window, loss, tracker)
    dropped: list[DroppedGroup] = []
    for _ in range(len(window.groups) + 1):
        run.replay_due()
        failed = _exchange_failures(learner, run.failures)
        if not failed:
            break
        for gi, reason in sorted(failed.items()):
            tree_ids = tuple(t.id for t in window.groups[gi].trees)
            dropped.append(DroppedGroup(gi, tree_ids, reason))
            log.error(
                "group %d (trees %s) dropped from the update: %s", gi, [t[:12] for t in tree_ids], reason
            )
        alive = run.window.alive - set(failed)
        if not alive:
            reasons = "; ".join(f"group {d.index}: {d.reason}" for d in dropped)
            raise ManifestError(f"every group of the update was dropped, nothing to train on ({reasons})")
        learner.discard()
        reopened = open_window(
            learner, window.groups, run.window.plan, loss, alive=alive, placement=window.placement
        )
        run = _Replay(learner, reopened, loss, tracker, run)
    learner.current_tree = None
    counters = dataclasses.replace(run.counters, local=run.local, dropped=tuple(dropped))
    return run.window, counters


def _exchange_failures(learner: Learner, failures: dict[int, str]) -> dict[int, str]:
    """Every rank's failed groups (collective); the first rank's reason for each."""
    per_rank = learner.backend.gather(json.dumps(sorted(failures.items())))
    failed: dict[int, str] = {}
    for rank, text in enumerate(per_rank):
        for gi, reason in json.loads(text):
            failed.setdefault(int(gi), f"rank {rank}: {reason}")
    return failed


class _Replay:
    """One pass of `replay_window` over one window: its replayer, its failures and its counters."""

    def __init__(
        self,
        learner: Learner,
        window: UpdateWindow,
        loss: LossConfig,
        tracker: MemoryProbe | None,
        before: _Replay | None = None,
    ) -> None:
        self.learner, self.window, self.loss, self.tracker = learner, window, loss, tracker
        self.replayer: TreeReplay | FlatReference = learner.replayer(window.plan, loss, tracker)
        self.failures: dict[int, str] = {}
        self.local = ReplayReport()
        self.counters: Replayed = before.counters if before is not None else Replayed()
        self.resets_by_group: dict[int, int] = before.resets_by_group if before is not None else {}
        self.group_of = {t.id: gi for gi in window.alive for t in window.groups[gi].trees}
        self.lockstep = learner.backend.context_size > 1
        """A context group's ranks replay in lockstep: no rank retries, narrows or drops alone."""

    def replay_due(self) -> None:
        """Replay every tree not covered yet whose group has not failed (after a reset: all of them)."""
        while pending := [tid for tid in self.window.work if self._due(tid)]:
            for tid in pending:
                if self._due(tid):  # a failure or a reset during this pass changes what is due
                    self.replay(tid)

    def _due(self, tid: str) -> bool:
        w = self.window
        return self.group_of[tid] not in self.failures and not w.claims.is_covered(w.keys(w.work[tid]))

    def replay(self, tree_id: str) -> None:
        """Replay this rank's share of one tree, retrying what may be retried."""
        w, learner = self.window, self.learner
        work = w.work.get(tree_id)
        if work is None:
            raise ManifestError(
                f"tree {tree_id[:12]} has no contributions on rank {learner.backend.rank} in this window"
            )
        group, keys = self.group_of[tree_id], w.keys(work)
        w.claims.claim(keys)
        if group in self.failures:
            w.claims.release(keys)
            return
        learner.current_tree = tree_id
        attempts = learner.retries.tree_attempts
        for attempt in range(attempts):
            if attempt:
                self._count(tree_retries=1)
                w.claims.claim(keys)
            before = learner.backward_calls
            try:
                report = self._accumulate(UpdateBatch((work,), w.manifest))
            except Exception as exc:
                learner.store.clear()
                w.claims.release(keys)
                transient = is_transient(exc)
                if not transient or self.lockstep:
                    if learner.backward_calls != before:
                        self._discard()
                    if not transient:
                        raise
                    first = (str(exc).splitlines() or [""])[0][:200]
                    raise LockstepFault(
                        f"rank {learner.backend.rank}: {type(exc).__name__} in tree {tree_id[:12]} ({first}); the "
                        "ranks of a context group replay in lockstep and none retries alone, so the run stops "
                        "with it: lower the memory a step needs (rollout sizes, replay.microbatch) or raise "
                        "distributed.context_parallel, and --resume redoes the update"
                    ) from exc
                where = f"{type(exc).__name__} in tree {tree_id[:12]}"
                if isinstance(exc, BackwardFailed) or learner.backward_calls != before:
                    self._reset(group, f"{where} after a backward of it ran: {exc}")
                    self._narrow_after_oom(exc)
                    return
                log.warning("rank %d: %s before any backward (%s)", learner.backend.rank, where, exc)
                if attempt + 1 == attempts:
                    self._fail(group, f"tree {tree_id[:12]} failed {attempts} times before backward: {exc!r}")
                continue
            w.claims.commit(keys)
            self.local = self.local.merged(report)
            return

    def _accumulate(self, batch: UpdateBatch) -> ReplayReport:
        replayer = self.replayer
        if isinstance(replayer, TreeReplay):
            return replayer.accumulate(batch, self.window.schedule)
        return replayer.accumulate(batch)  # flat mode: nothing laid out

    def _count(self, *, tree_retries: int = 0, window_resets: int = 0) -> None:
        c = self.counters
        self.counters = dataclasses.replace(
            c, tree_retries=c.tree_retries + tree_retries, window_resets=c.window_resets + window_resets
        )

    def _discard(self) -> None:
        """Forget this rank's gradients and coverage (the trees are replayed again if needed)."""
        self.learner.backend.reset_window()
        self.window.claims.reset()
        self.local = ReplayReport()

    def _reset(self, group: int, reason: str) -> None:
        self._discard()
        self._count(window_resets=1)
        n = self.resets_by_group[group] = self.resets_by_group.get(group, 0) + 1
        log.warning("rank %d: update window reset (%s); replaying it", self.learner.backend.rank, reason)
        if n >= self.learner.retries.window_attempts:
            self._fail(group, f"backward failed {n} times; last: {reason}")

    def _narrow_after_oom(self, exc: BaseException) -> None:
        """After an out-of-memory error in backward, replay with half as many sibling rows per step (K): the
        plan narrowed, laid out again, and a fresh replayer. A split before backward happens inside the
        replayer; once backward has started only a reset can undo the step, and the same K would most
        likely run out of memory again."""
        cause = exc.__cause__ if isinstance(exc, BackwardFailed) else exc
        replayer = self.replayer
        if not isinstance(cause, torch.OutOfMemoryError) or not isinstance(replayer, TreeReplay):
            return
        widest = replayer.widest_step
        if widest > 1:
            k = widest // 2
            log.warning(
                "rank %d: replaying with K = %d after running out of memory", self.learner.backend.rank, k
            )
            w, learner = self.window, self.learner
            plan = w.plan.narrower(k)
            schedule, crossing = laid_out(learner, plan, w.share, self.loss)
            self.window = dataclasses.replace(w, plan=plan, schedule=schedule, context_bytes=crossing)
            self.replayer = learner.replayer(plan, self.loss, self.tracker)

    def _fail(self, group: int, reason: str) -> None:
        self.failures[group] = reason
        log.error("rank %d: group %d cannot be completed: %s", self.learner.backend.rank, group, reason)
