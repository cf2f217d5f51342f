"""The update (`run_update`, as the trainer calls it) without DeepSpeed: exactly-once accounting and fault
handling, on one process and on ranks simulated by threads (tests/support/fake_world.py). References are the
engine run directly (dist_cases), compared as SGD deltas (-lr * g), so a gradient of the wrong scale fails as
surely as a wrong direction."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from support.dist_cases import (
    ADAMW,
    LOSS,
    OPTIMIZER,
    delta_floor,
    groups,
    make_model,
    params_vector,
    rollouts,
    settings,
    update,
)
from support.fake_world import FlakyBackend, ThreadRankBackend, ThreadWorld

from treetrain.distributed import (
    AgreementError,
    DuplicateContributionError,
    OptimizerConfig,
    TorchBackend,
    round_robin,
)
from treetrain.distributed.backend_choice import make_backend
from treetrain.distributed.checkpoint_io import CheckpointError
from treetrain.errors import ConfigError
from treetrain.loss.manifest import ManifestError
from treetrain.memory.overrides import Mode
from treetrain.memory.retention import BudgetTooSmallError
from treetrain.models.support import UnsupportedModelError
from treetrain.replay import BackwardFailed, TreeReplay, UpdateBatch
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.resident import ResidentIdentity, ResidentKey, ResidentStore, StaleResidentStateError
from treetrain.replay.schedule import ReplayStep
from treetrain.update.faults import LockstepFault, is_transient, replay_window
from treetrain.update.learner import Learner
from treetrain.update.planning import plan_for
from treetrain.update.run import run_update
from treetrain.update.window import open_window
from treetrain.update.window_types import WindowConfig

FACTOR = 5.0


@pytest.fixture(scope="module")
def flat() -> tuple[torch.Tensor, float]:
    return delta_floor("flat", groups())


def _close(delta: torch.Tensor, ref: tuple[torch.Tensor, float]) -> None:
    err = float((delta - ref[0]).norm())
    assert err <= FACTOR * ref[1], f"|delta - reference| = {err:.3e} > {FACTOR} x {ref[1]:.3e}"


def _far(delta: torch.Tensor, ref: tuple[torch.Tensor, float], what: str) -> float:
    """Negative controls: the error must be far outside the tolerance; returns error / floor."""
    err = float((delta - ref[0]).norm())
    assert err > 100 * FACTOR * ref[1], f"{what}: {err:.3e} is not far above the floor {ref[1]:.3e}"
    return err / ref[1]


def _run(
    backend: TorchBackend | None = None, *, mode: Mode = "tree", step_hook: Any = None
) -> tuple[torch.Tensor, Any]:
    backend = backend or TorchBackend(make_model(), OPTIMIZER)
    start = params_vector(backend.module)
    learner = Learner(backend, hooks=ReplayHooks(step=step_hook))
    report = update(learner, groups(), settings(mode, None if mode == "flat" else 0))
    return params_vector(backend.module) - start, report


class Raise:
    """A step hook raising `exc` at the listed (phase, occurrence) points."""

    def __init__(self, phase: str, at: set[int], exc: Exception, when: Any = None) -> None:
        self.phase, self.at, self.exc, self.when = phase, at, exc, when
        self.count = 0

    def __call__(self, phase: str, step: ReplayStep) -> None:
        if phase != self.phase or (self.when is not None and not self.when(step)):
            return
        self.count += 1
        if self.count in self.at:
            raise self.exc


@pytest.mark.parametrize("mode", ["tree", "flat"])
def test_single_process_window_matches_the_engine_run_directly(
    flat: tuple[torch.Tensor, float], mode: str
) -> None:
    delta, report = _run(mode=mode)
    _close(delta, flat)
    assert report.version == 1 and report.contributions == 10 and not report.dropped


def test_exception_before_backward_retries_only_that_tree(flat: tuple[torch.Tensor, float]) -> None:
    delta, report = _run(step_hook=Raise("forward", {1}, RuntimeError("boom")))
    _close(delta, flat)
    assert (report.tree_retries, report.window_resets) == (1, 0)


def test_exception_after_a_backward_of_the_tree_resets_the_window(flat: tuple[torch.Tensor, float]) -> None:
    delta, report = _run(step_hook=Raise("backward", {2}, RuntimeError("boom")))
    _close(delta, flat)
    assert (report.tree_retries, report.window_resets) == (0, 1)


def test_failure_inside_backward_resets_the_window(flat: tuple[torch.Tensor, float]) -> None:
    delta, report = _run(FlakyBackend(make_model(), OPTIMIZER, fail_on=[3]))
    _close(delta, flat)
    assert report.window_resets == 1


def test_out_of_memory_splits_the_step(flat: tuple[torch.Tensor, float]) -> None:
    hook = Raise("forward", {1}, torch.OutOfMemoryError("simulated"), when=lambda s: len(s.units) > 1)
    delta, report = _run(step_hook=hook)
    _close(delta, flat)
    assert report.local.oom_splits == 1 and report.window_resets == 0


class WideStepOOMBackend(TorchBackend):
    """Runs out of memory inside backward whenever the step has more than one sibling row, every time."""

    width = 0

    def hook(self, phase: str, step: ReplayStep) -> None:
        self.width = len(step.units)

    def backward(self, loss: torch.Tensor) -> None:
        if self.width > 1:
            loss.backward()  # part of the gradient lands before the failure, as in a real OOM
            raise torch.OutOfMemoryError("simulated: backward of a wide step")
        loss.backward()


def test_repeated_out_of_memory_in_backward_narrows_k(
    flat: tuple[torch.Tensor, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Splitting cannot help once backward has started; the window resets and replays with a smaller K."""
    backend = WideStepOOMBackend(make_model(), OPTIMIZER)
    delta, report = _run(backend, step_hook=backend.hook)
    _close(delta, flat)
    assert not report.dropped and report.window_resets == 1  # two siblings per step, then K = 1
    # Without narrowing, every attempt fails the same way and the groups are dropped.
    monkeypatch.setattr("treetrain.update.faults._Replay._narrow_after_oom", lambda self, exc: None)
    backend = WideStepOOMBackend(make_model(), OPTIMIZER)
    with pytest.raises(ManifestError, match="dropped"):
        _run(backend, step_hook=backend.hook)


def test_out_of_memory_in_backward_lays_out_a_narrower_plan_for_a_fresh_replayer(
    flat: tuple[torch.Tensor, float],
) -> None:
    """The update narrows its plan to half the widest step's rows and builds a new replayer from it; the
    first replayer and the update's plan are left as they were, and the update equals flat."""
    backend = WideStepOOMBackend(make_model(), OPTIMIZER)
    start = params_vector(backend.module)
    learner = Learner(backend, hooks=ReplayHooks(step=backend.hook))
    built: list[Any] = []
    replayer = learner.replayer
    learner.replayer = lambda plan, loss, tracker=None: (
        built.append((plan, replayer(plan, loss, tracker))) or built[-1][1]
    )  # type: ignore[method-assign]
    outcome = run_update(learner, settings(), rollouts(groups()))
    assert [p.microbatch for p, _ in built] == [0, 1] and outcome.plan is built[0][0]
    first, second = built[0][1], built[1][1]
    assert isinstance(first, TreeReplay) and isinstance(second, TreeReplay) and first is not second
    assert first.widest_step == 2 and second.widest_step == 1 and first.cfg.microbatch == 0
    assert outcome.report is not None and outcome.report.window_resets == 1 and not outcome.report.dropped
    _close(params_vector(backend.module) - start, flat)


PERMANENT = [
    ValueError("bad input"),
    TypeError("bad type"),
    IndexError("no such unit"),
    KeyError("no such node"),
    StaleResidentStateError("stale"),
    ManifestError("bad manifest"),
    UnsupportedModelError("unsupported"),
    BudgetTooSmallError(1, 2, "unit 3"),
]


@pytest.mark.parametrize("exc", PERMANENT, ids=lambda e: type(e).__name__)
def test_a_permanent_error_is_raised_at_once_without_retry_or_drop(exc: Exception) -> None:
    backend = TorchBackend(make_model(), OPTIMIZER)
    start = params_vector(backend.module)
    hook = Raise("forward", {1}, exc)
    learner = Learner(backend, hooks=ReplayHooks(step=hook))
    with pytest.raises(type(exc)) as raised:
        update(learner, groups())
    assert raised.value is exc and hook.count == 1, "retried"
    assert learner.version == 0 and all(p.grad is None for p in backend.params)
    assert torch.equal(params_vector(backend.module), start)


def test_a_permanent_error_after_a_backward_discards_the_partial_gradient(
    flat: tuple[torch.Tensor, float],
) -> None:
    """Raised at once; what the tree accumulated is gone, so a caller that goes on replays it exactly."""
    backend = TorchBackend(make_model(), OPTIMIZER)
    start = params_vector(backend.module)
    hook = Raise("backward", {2}, ValueError("bad advantage"))
    learner = Learner(backend, hooks=ReplayHooks(step=hook))
    with pytest.raises(ValueError, match="bad advantage"):
        update(learner, groups())
    assert all(p.grad is None for p in backend.params) and learner.version == 0
    report = update(learner, groups())
    assert report.window_resets == 0 and report.tree_retries == 0
    _close(params_vector(backend.module) - start, flat)


class BadInputBackend(TorchBackend):
    """A backward that fails with a ValueError (bad input reaching autograd), not a fault."""

    def backward(self, loss: torch.Tensor) -> None:
        raise ValueError("loss is not a scalar")


def test_a_backward_failing_on_bad_input_is_not_retried() -> None:
    learner = Learner(BadInputBackend(make_model(), OPTIMIZER))
    with pytest.raises(BackwardFailed) as raised:
        update(learner, groups())
    assert isinstance(raised.value.__cause__, ValueError)
    assert learner.backward_calls == 1 and learner.version == 0


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (RuntimeError("NCCL timeout"), True),
        (torch.OutOfMemoryError("oom"), True),
        (OSError("disk"), True),
        (BackwardFailed("step 3"), True),
        (NotImplementedError("todo"), False),
        (AssertionError("bug"), False),
        (*PERMANENT[:1], False),
        (ManifestError("m"), False),
        (StaleResidentStateError("s"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_transient_and_permanent_kinds(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient
    wrapped = BackwardFailed("backward failed")
    wrapped.__cause__ = exc
    assert is_transient(wrapped) is transient


class TreeFault(Raise):
    """A hook that always raises while `tree_id` is being replayed by `learner` (given once it is built)."""

    def __init__(self, tree_id: str) -> None:
        super().__init__("forward", set(range(1, 1000)), RuntimeError("broken tree"), when=self._in_tree)
        self.tree_id = tree_id
        self.learner: Learner | None = None

    def _in_tree(self, step: ReplayStep) -> bool:
        return self.learner is not None and self.learner.current_tree == self.tree_id


def test_a_group_that_keeps_failing_is_dropped_whole(caplog: pytest.LogCaptureFixture) -> None:
    backend = TorchBackend(make_model(), OPTIMIZER)
    start = params_vector(backend.module)
    fault = TreeFault(groups()[1].trees[0].id)
    learner = Learner(backend, retries=WindowConfig(tree_attempts=2), hooks=ReplayHooks(step=fault))
    fault.learner = learner
    with caplog.at_level(logging.ERROR, logger="treetrain.update"):
        report = update(learner, groups())
    assert [d.index for d in report.dropped] == [1] and "broken tree" in report.dropped[0].reason
    assert any("dropped from the update" in r.message for r in caplog.records)
    assert report.contributions == 6 and report.tree_retries == 1
    _close(params_vector(backend.module) - start, delta_floor("flat", groups()[:1]))


def test_every_group_failing_refuses_the_step() -> None:
    backend = TorchBackend(make_model(), OPTIMIZER)
    start = params_vector(backend.module)
    hooks = ReplayHooks(step=Raise("forward", set(range(1, 99)), RuntimeError("x")))
    learner = Learner(backend, retries=WindowConfig(tree_attempts=1), hooks=hooks)
    with pytest.raises(ManifestError, match="every group of the update was dropped"):
        update(learner, groups())
    assert torch.equal(params_vector(backend.module), start) and learner.version == 0


def test_a_replayed_contribution_cannot_be_claimed_again() -> None:
    """Steps 4 and 5 of `run_update` on their own: after the replay every key of this rank is covered, and
    a second claim of any of them (a second replay) is refused instead of counted twice."""
    backend = TorchBackend(make_model(), OPTIMIZER)
    learner = Learner(backend)
    update_groups = groups()
    trees = [t for g in update_groups for t in g.trees]
    batch = UpdateBatch.build(trees, [a for g in update_groups for a in g.advantages], LOSS)
    plan = plan_for(settings(), batch, backend.module, None)
    window, replayed = replay_window(
        learner, open_window(learner, update_groups, plan, LOSS, batch=batch), LOSS
    )
    assert replayed.tree_retries == 0 and window.claims.complete
    for work in window.work.values():
        with pytest.raises(DuplicateContributionError, match="a second replay would count it twice"):
            window.claims.claim(window.keys(work))


def test_a_step_bumps_the_version_and_invalidates_resident_state() -> None:
    backend = TorchBackend(make_model(), OPTIMIZER)
    learner = Learner(backend, store=ResidentStore(ResidentIdentity.of(backend.module, tokenizer="tok-1")))
    tree = groups()[0].trees[0]
    key = ResidentKey(tree.id, 1, tree.nodes[1].id)
    old = learner.identity
    step = backend.step

    def put_then_step() -> bool:  # resident state still held when the optimizer steps
        learner.store.put(key, [(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))], old)
        return step()

    backend.step = put_then_step  # type: ignore[method-assign]
    assert update(learner, groups()).version == 1
    assert learner.version == 1 and learner.identity == old.bumped()
    with pytest.raises(StaleResidentStateError, match="invalidated by an optimizer step"):
        learner.store.get(key, learner.identity)
    with pytest.raises(StaleResidentStateError, match="the store holds identity"):
        learner.store.get(key, old)
    backend.step = step  # type: ignore[method-assign]
    assert update(learner, groups(1)).version == 2


def _thread_ranks(
    world: ThreadWorld,
    *,
    fail_on: dict[int, list[int]] | None = None,
    microbatch: Any = lambda rank: 0,
    version: Any = lambda rank: 0,
    hook: Any = lambda rank: None,
    mean: bool = False,
) -> list[Any]:
    """Run one update on every simulated rank; per rank, (delta, report) or the exception raised."""
    fail_on = fail_on or {}
    backends = [
        ThreadRankBackend(world, r, make_model(), OPTIMIZER, fail_on.get(r, ()), mean=mean)
        for r in range(world.size)
    ]
    trees = [t for g in groups() for t in g.trees]

    def rank_fn(r: int) -> Any:
        def fn() -> Any:
            start = params_vector(backends[r].module)
            store = ResidentStore(ResidentIdentity.of(backends[r].module, version=version(r)))
            step = hook(r)
            learner = Learner(backends[r], store=store, hooks=ReplayHooks(step=step))
            if isinstance(step, TreeFault):
                step.learner = learner
            cfg = settings(microbatch=microbatch(r), seed=r)
            report = update(learner, groups(), cfg, placement=round_robin(trees, world.size))
            return params_vector(backends[r].module) - start, report

        return fn

    return world.run([rank_fn(r) for r in range(world.size)])


class LockstepRank(ThreadRankBackend):
    """A simulated rank of one context group of every rank: the fault rule sees the group (the engine is
    not sharded here: each rank replays every tree whole, as the ranks of a group all run the same trees)."""

    @property
    def context_size(self) -> int:
        return self.world_size


def test_a_rank_of_a_context_group_stops_at_its_first_fault_instead_of_retrying_alone() -> None:
    """A transient fault before any backward is retried on a rank of its own (above); in a context group
    the rank stops at once with one line, since a retry alone would pair its collectives with the wrong
    ones of the other ranks (an out-of-memory error in a group's step reaches here too: the replayer splits
    a step only outside a group). The other rank, left in a collective, fails there (here: the barrier's
    timeout)."""
    world = ThreadWorld(2, timeout=5.0)
    hooks = [Raise("forward", {1}, RuntimeError("device error\nsecond line")), None]

    def rank_fn(r: int) -> Any:
        def fn() -> Any:
            backend = LockstepRank(world, r, make_model(), OPTIMIZER)
            return update(Learner(backend, hooks=ReplayHooks(step=hooks[r])), groups())

        return fn

    stopped, other = world.run([rank_fn(r) for r in range(2)])
    assert isinstance(stopped, LockstepFault) and isinstance(stopped.__cause__, RuntimeError)
    said = str(stopped)
    assert "\n" not in said and said.startswith("rank 0: RuntimeError in tree ") and "--resume" in said
    assert hooks[0] is not None and hooks[0].count == 1, "retried alone"
    assert isinstance(other, BaseException)


class DoublingBackend(TorchBackend):
    """Negative control: the gradient reaching the optimizer is twice the right one."""

    def step(self) -> bool:
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(2.0)
        return super().step()


def test_negative_control_a_doubled_gradient_is_far_outside_the_tolerance(
    flat: tuple[torch.Tensor, float],
) -> None:
    delta, _ = _run(DoublingBackend(make_model(), OPTIMIZER))
    print(f"doubled gradient: |delta - reference| = {_far(delta, flat, 'doubled'):.0f} x floor")


def test_negative_control_averaging_over_ranks_instead_of_summing_is_visible(
    flat: tuple[torch.Tensor, float],
) -> None:
    """The manifest normalizes the global sum: a mean over 2 ranks (DeepSpeed's default) halves it."""
    for delta, _ in _thread_ranks(ThreadWorld(2), mean=True):
        print(f"mean over ranks: |delta - reference| = {_far(delta, flat, 'mean'):.0f} x floor")
        _close(delta, (flat[0] / 2, flat[1]))


def test_adamw_window_matches_the_engine_run_directly() -> None:
    delta, _ = _run(TorchBackend(make_model(), ADAMW))
    _close(delta, delta_floor("flat", groups(), ADAMW))


class SkippingBackend(TorchBackend):
    """The optimizer skips the update (as DeepSpeed may on overflow)."""

    def step(self) -> bool:
        self.optimizer.zero_grad(set_to_none=True)
        return False


def test_a_skipped_step_still_counts_as_a_committed_window() -> None:
    backend = SkippingBackend(make_model(), OPTIMIZER)
    start = params_vector(backend.module)
    learner = Learner(backend)
    tree = groups()[0].trees[0]
    key = ResidentKey(tree.id, 1, tree.nodes[1].id)
    step = backend.step

    def put_then_step() -> bool:  # resident state still held when the optimizer skips its step
        learner.store.put(key, [(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))], learner.identity)
        return step()

    backend.step = put_then_step  # type: ignore[method-assign]
    report = update(learner, groups())
    assert not report.step_applied and report.version == learner.version == 1
    assert torch.equal(params_vector(backend.module), start)
    with pytest.raises(StaleResidentStateError):
        learner.store.get(key, learner.identity)


def test_thread_ranks_match_one_process_under_faults(flat: tuple[torch.Tensor, float]) -> None:
    results = _thread_ranks(
        ThreadWorld(3),
        fail_on={1: [2]},
        microbatch=lambda r: r,
        hook=lambda r: Raise("forward", {1}, RuntimeError("x")) if r == 2 else None,
    )
    for delta, _ in results:
        _close(delta, flat)
    assert [rep.window_resets for _, rep in results] == [0, 1, 0] and results[2][1].tree_retries == 1


def test_thread_ranks_drop_a_group_that_one_rank_cannot_finish() -> None:
    victim = groups()[1].trees[0].id
    results = _thread_ranks(ThreadWorld(2), hook=lambda r: TreeFault(victim) if r == 1 else None)
    reference = delta_floor("flat", groups()[:1])
    for delta, report in results:
        assert [d.index for d in report.dropped] == [1] and report.dropped[0].reason.startswith("rank 1: ")
        _close(delta, reference)


def test_thread_ranks_refuse_a_version_mismatch() -> None:
    results = _thread_ranks(ThreadWorld(2), version=lambda r: r)
    for exc in results:
        assert isinstance(exc, AgreementError) and "ranks [1] differ" in str(exc)


def test_torch_checkpoint_resume_reproduces_the_next_update(tmp_path: Any) -> None:
    backend = TorchBackend(make_model(), OPTIMIZER)
    learner = Learner(backend)
    update(learner, groups(0))
    backend.save_checkpoint(tmp_path / "ckpt", {"version": 0})
    backend.save_checkpoint(tmp_path / "ckpt", {"version": learner.version})  # replaces atomically
    update(learner, groups(1))
    fresh = TorchBackend(make_model(), OPTIMIZER)
    state = fresh.load_checkpoint(tmp_path / "ckpt")
    assert state == {"version": 1}
    update(
        Learner(fresh, store=ResidentStore(ResidentIdentity.of(fresh.module, version=state["version"]))),
        groups(1),
    )
    assert torch.equal(params_vector(fresh.module), params_vector(backend.module))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(CheckpointError, match="not JSON-serializable"):
        backend.save_checkpoint(tmp_path / "ckpt", {"rng": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and fresh.load_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "client_state.json").write_text(
        '{"schema": "treetrain.client_state/1", "client_state": 3}'
    )
    with pytest.raises(CheckpointError, match="field 'client_state' must be an object"):
        fresh.load_checkpoint(tmp_path / "ckpt")


def test_make_backend_reads_trainer_settings() -> None:
    @dataclass(frozen=True)
    class Distributed:
        backend: str = "torch"
        zero_stage: int = 0
        offload_optimizer: bool = False
        deepspeed_config: str | None = None
        context_parallel: int = 1

    optim = OptimizerConfig(lr=1e-3, betas=(0.9, 0.99), grad_clip=0.0)
    backend = make_backend(make_model(), optim, Distributed())
    assert (
        isinstance(backend, TorchBackend)
        and backend.cfg.grad_clip == 0.0
        and backend.cfg.betas == (0.9, 0.99)
        and isinstance(backend.optimizer, torch.optim.AdamW)
    )
    assert (backend.zero_stage, backend.offload_optimizer) == (0, False)
    with pytest.raises(ConfigError, match=r"distributed\.backend must be 'torch' or 'deepspeed'"):
        make_backend(make_model(), optim, Distributed(backend="horovod"))
    with pytest.raises(ConfigError, match=r"context_parallel > 1 needs distributed\.backend: deepspeed"):
        make_backend(make_model(), optim, Distributed(context_parallel=2))

    sgd = make_backend(make_model(), OptimizerConfig(name="sgd"), Distributed())
    assert isinstance(sgd, TorchBackend) and type(sgd.optimizer) is torch.optim.SGD
    with pytest.raises(ConfigError, match=r"optim\.name must be 'adamw' or 'sgd'"):
        OptimizerConfig(name="lion")  # type: ignore[arg-type]


def test_negative_control_a_tree_counted_twice_is_far_outside_the_tolerance(
    flat: tuple[torch.Tensor, float],
) -> None:
    """A replayer that accumulates its first tree twice, behind the claims' back, moves the update far."""
    backend = TorchBackend(make_model(), OPTIMIZER)
    start = params_vector(backend.module)
    learner = Learner(backend)
    replayer = learner.replayer

    def twice(plan: Any, loss: Any, tracker: Any = None) -> Any:
        built = replayer(plan, loss, tracker)
        once = built.accumulate
        calls = [0]

        def accumulate(batch: UpdateBatch, schedule: Any = None) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                once(batch, schedule)
            return once(batch, schedule)

        built.accumulate = accumulate
        return built

    learner.replayer = twice  # type: ignore[method-assign]
    update(learner, groups())
    assert float((params_vector(backend.module) - start - flat[0]).norm()) > 100 * FACTOR * flat[1]


def test_the_update_takes_over_a_given_identity_and_store() -> None:
    backend = TorchBackend(make_model(), OPTIMIZER)
    identity = ResidentIdentity.of(backend.module, version=7, tokenizer="tok")
    store = ResidentStore(identity)
    learner = Learner(backend, store=store)
    assert learner.identity == identity
    assert update(learner, groups()).version == 8
    assert learner.identity == identity.bumped() and store.identity == identity.bumped()


def test_torch_backend_refuses_a_non_finite_step() -> None:
    """A NaN gradient never reaches the weights: the step raises and the gradients are discarded."""
    import math

    from treetrain.models.presets import tiny_model

    model = tiny_model("llama", 32)
    backend = TorchBackend(model, OptimizerConfig(lr=0.1, grad_clip=0.0))
    before = [p.detach().clone() for p in model.parameters()]
    backend.backward(sum(p.sum() for p in model.parameters()) * math.nan)
    with pytest.raises(FloatingPointError, match="refused"):
        backend.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
