"""The fault and refusal scenarios of tests/distributed/worker.py: failures injected at each phase of a
distributed update (before and inside backward, out of memory, a group no rank can finish), and the
collective checks that must refuse a doubled, skipped, stale or mismatched contribution.

Each returns the parameter delta and an `Info` record, as every scenario does; an expected refusal is caught
on every rank, so all ranks take the same collective path.
"""

from __future__ import annotations

from typing import Any

import torch

from support.dist_cases import LOSS, groups
from support.dist_update import Info, backend_for, current, one_update, store_at
from treetrain.distributed import AgreementError, CoverageClaims, DuplicateContributionError
from treetrain.loss.manifest import ManifestError
from treetrain.replay import UpdateBatch
from treetrain.replay.resident import ResidentKey, StaleResidentStateError
from treetrain.update.window import UpdateWindow


def no_rescale(stage_name: str) -> tuple[torch.Tensor, Info]:
    """Negative control: the backend's `x dp_world_size` before DeepSpeed's mean is left out."""

    def body(opened: Any) -> None:
        opened.backend._scale_local_grads = lambda factor: None

    return one_update(stage_name, body=body)


class Once:
    """Raise `exc` the `nth` time (phase, rank) matches; later calls pass."""

    def __init__(self, rank: int, phase: str, exc: Exception, nth: int = 1, times: int = 1) -> None:
        self.rank, self.phase, self.exc, self.nth, self.times = rank, phase, exc, nth, times
        self.seen = 0

    def __call__(self, phase: str, step: Any) -> None:
        if phase != self.phase or torch.distributed.get_rank() != self.rank:
            return
        self.seen += 1
        if self.nth <= self.seen < self.nth + self.times:
            raise self.exc


class MultiUnitOOM:
    """Simulated out-of-memory on the first forward of a step with several units, on every rank."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, phase: str, step: Any) -> None:
        if phase == "forward" and len(step.units) > 1 and not self.fired:
            self.fired = True
            raise torch.OutOfMemoryError("simulated out of memory")


def mid_backward(stage_name: str) -> tuple[torch.Tensor, Info]:
    """A hook on an early parameter raises inside autograd on rank 0, after later layers accumulated."""
    state = {"armed": torch.distributed.get_rank() == 0}

    def body(opened: Any) -> None:
        first = next(opened.backend.module.parameters())

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if state["armed"]:
                state["armed"] = False
                raise RuntimeError("injected failure in the middle of backward")
            return grad

        first.register_hook(hook)

    return one_update(stage_name, body=body)


def duplicate(stage_name: str) -> tuple[torch.Tensor, Info]:
    refused: list[str] = []

    def body(opened: Any) -> None:
        opened.replay_all()
        for tree_id in opened.work:
            try:
                opened.replay(tree_id)
            except DuplicateContributionError as exc:
                refused.append(str(exc))

    delta, info = one_update(stage_name, body=body)
    info["refused"] = refused
    return delta, info


def drop_group(stage_name: str) -> tuple[torch.Tensor, Info]:
    """Rank 1 can never finish group 1's tree: the group is dropped on every rank, group 0 is trained."""
    update = groups()
    victim = update[1].trees[0].id

    def hook(phase: str, step: Any) -> None:
        if torch.distributed.get_rank() == 1 and phase == "forward" and current_tree.get("id") == victim:
            raise RuntimeError("injected persistent failure")

    current_tree: dict[str, str] = {}

    def body(opened: Any) -> None:
        original = opened.replay

        def tracking(tree_id: str) -> None:
            current_tree["id"] = tree_id
            original(tree_id)

        opened.replay = tracking

    return one_update(stage_name, step_hook=hook, body=body, placement="round_robin")


# ----- refusals and negative controls -------------------------------------------------------------
def stale_and_version(stage_name: str) -> tuple[torch.Tensor, Info]:
    info: Info = {}
    backend = backend_for(stage_name)
    start = current(backend)
    mismatched = UpdateWindow(backend, LOSS, store=store_at(backend, backend.rank))
    try:
        mismatched.open(groups())
        info["version_mismatch"] = "not refused"
    except AgreementError as exc:
        info["version_mismatch"] = str(exc)
    window = UpdateWindow(backend, LOSS)
    opened = window.open(groups())
    opened.replay_all()
    tree = groups()[0].trees[0]
    key = ResidentKey(tree.id, 1, tree.nodes[1].id)
    old = window.identity
    window.store.put(key, [(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))], old)
    opened.commit()
    for name, identity in (("stale_old_identity", old), ("stale_new_identity", window.identity)):
        try:
            window.store.get(key, identity)
            info[name] = "not refused"
        except StaleResidentStateError as exc:
            info[name] = str(exc)
    return current(backend) - start, info


def coverage_controls(stage_name: str) -> tuple[torch.Tensor, Info]:
    """The collective coverage check refuses a doubled and a missing contribution (rank 1's claims are
    replaced after its replay, as if it had covered one of rank 0's keys, or lost one of its own)."""
    info: Info = {}
    backend = backend_for(stage_name)
    start = current(backend)
    for case in ("doubled", "missing"):
        window = UpdateWindow(backend, LOSS)
        opened = window.open(groups())
        opened.replay_all()
        if backend.rank == 1:
            mine = sorted(opened.claims.covered)
            if case == "doubled":
                other = sorted(set(opened.manifest.keys()) - set(mine))[0]
                keys = [*mine, other]
            else:
                keys = mine[1:]
            tampered = CoverageClaims(keys)
            tampered.claim(keys)
            tampered.commit(keys)
            opened.claims = tampered
        try:
            opened.check()  # the collective check commit() runs before stepping
            info[case] = "not refused"
        except ManifestError as exc:
            info[case] = str(exc)
        backend.reset_window()
    return current(backend) - start, info


def bypass(stage_name: str, kind: str) -> tuple[torch.Tensor, Info]:
    """Numeric negative controls: rank 1 doubles or skips a tree behind the claims' back."""

    def body(opened: Any) -> None:
        if opened.backend.rank != 1:
            return
        tree_id = next(iter(opened.work))
        work = opened.work[tree_id]
        keys = opened.keys(work)
        if kind == "double":
            opened.replay(tree_id)
            opened.replayer.accumulate(UpdateBatch((work,), opened.manifest))
        else:
            opened.claims.claim(keys)
            opened.claims.commit(keys)

    return one_update(stage_name, body=body, placement="round_robin")
