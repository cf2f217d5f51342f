"""Distributed scenarios for tests/distributed/test_distributed.py: run as `torchrun --nproc_per_node=2 worker.py OUT`.

Every scenario builds a fresh tiny model and a fresh DeepSpeed engine, runs one update (sometimes with a
fault injected) and rank 0 writes the parameter delta to OUT/<name>.safetensors and what happened to
OUT/<name>.json. The pytest side compares the deltas with single-process references. A scenario that raises
writes OUT/<name>.error.rank<r>.txt instead; scenarios are written so that every rank takes the same
collective path, and an expected refusal is caught on every rank.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed
import torch
from safetensors.torch import save_file
from support.dist_cases import (
    ADAMW,
    LORA_LOSS,
    LOSS,
    OPTIMIZER,
    RECURRENT_DIST,
    STAGES,
    groups,
    lm_loss,
    make_lora_model,
    make_model,
    model_factory,
    params_vector,
    pitfall_batches,
    settings,
    uneven_groups,
    uneven_owned,
)
from support.dist_cases import (
    update as dist_update,
)

from treetrain.distributed import (
    AgreementError,
    CoverageClaims,
    DuplicateContributionError,
    OptimizerConfig,
    build_placement,
    round_robin,
)
from treetrain.distributed.backend_choice import make_backend
from treetrain.distributed.checkpoint_io import CheckpointError
from treetrain.distributed.deepspeed_backend import DeepSpeedBackend
from treetrain.loss.manifest import ManifestError
from treetrain.memory.calibrate import calibrate
from treetrain.memory.calibration_probes import Probe
from treetrain.memory.persistent import largest_module
from treetrain.models.lora import AdaptersOff, is_adapter_param
from treetrain.replay import TreeReplay, UpdateBatch
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.resident import ResidentIdentity, ResidentKey, ResidentStore, StaleResidentStateError
from treetrain.replay.schedule import Contract
from treetrain.update.learner import Learner
from treetrain.update.window import UpdateWindow
from treetrain.update.window_types import WindowConfig

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
ONLY = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else None
Info = dict[str, Any]


USER_CONFIG_STAGES = {"z1"}
"""Stages whose backend is built from a user DeepSpeed config (a mapping) instead of arguments."""


def backend_for(
    stage_name: str, optimizer: OptimizerConfig = OPTIMIZER, *, measure: bool = False, family: str = "llama"
) -> DeepSpeedBackend:
    stage, offload = STAGES[stage_name]
    model = model_factory(family)()
    if stage_name in USER_CONFIG_STAGES:
        offload_block = {"device": "cpu" if offload else "none"}
        user = {"zero_optimization": {"stage": stage, "offload_optimizer": offload_block}}
        return DeepSpeedBackend(model, ds_config=user, optimizer=optimizer, measure_params=measure)
    return DeepSpeedBackend(
        model, zero_stage=stage, offload_optimizer=offload, optimizer=optimizer, measure_params=measure
    )


def current(backend: DeepSpeedBackend) -> torch.Tensor:
    params = list(backend.module.parameters())
    gathered = deepspeed.zero.GatheredParameters(params) if backend.zero_stage == 3 else nullcontext()
    with gathered:
        return params_vector(backend.module)


def param_storage(backend: DeepSpeedBackend) -> int:
    """Bytes of parameter storage on this rank now: full tensors and, under ZeRO-3, partitions."""
    total = 0
    for p in backend.module.parameters():
        total += p.data.numel() * p.element_size()
        part = getattr(p, "ds_tensor", None)
        if part is not None:
            total += part.numel() * part.element_size()
    return total


@contextmanager
def around_replay(
    before: Callable[[UpdateWindow, Learner], None] | None = None,
    after: Callable[[UpdateWindow, Learner], UpdateWindow | None] | None = None,
) -> Iterator[None]:
    """`run_update` as it is, with a seam around its step 5 (`replay_window`): `before` sees the opened
    window, `after` the replayed one and may hand back a changed one (the coverage controls' tampering)."""
    import treetrain.update.run as run

    real = run.replay_window

    def wrapped(learner: Learner, window: UpdateWindow, loss: Any, tracker: Any = None) -> Any:
        if before is not None:
            before(window, learner)
        window, replayed = real(learner, window, loss, tracker)
        if after is not None:
            window = after(window, learner) or window
        return window, replayed

    run.replay_window = wrapped  # type: ignore[assignment]
    try:
        yield
    finally:
        run.replay_window = real


def one_update(
    stage_name: str,
    contract: Contract = "exact",
    *,
    microbatch: int = 0,
    placement: str = "planner",
    step_hook: Callable[..., None] | None = None,
    body: Callable[[UpdateWindow, Learner], None] | None = None,
    optimizer: OptimizerConfig = OPTIMIZER,
    update: list[Any] | None = None,
    measure: bool = False,
    family: str = "llama",
    **window_kw: Any,
) -> tuple[torch.Tensor, Info]:
    backend = backend_for(stage_name, optimizer, measure=measure, family=family)
    start = current(backend)
    update = groups() if update is None else update
    trees = [t for g in update for t in g.trees]
    sampled = [0]

    def sample(phase: str, step: Any) -> None:  # parameter storage at every replay phase
        sampled[0] = max(sampled[0], param_storage(backend))
        if step_hook is not None:
            step_hook(phase, step)

    learner = Learner(backend, retries=WindowConfig(**window_kw), hooks=ReplayHooks(step=sample))
    if placement == "round_robin":
        given = round_robin(trees, backend.world_size)
    elif placement in ("uneven", "idle"):
        given = build_placement(
            trees, uneven_owned(update, backend.world_size, placement), backend.world_size
        )
    else:
        given = None
    backend.reset_param_peak()
    seen: dict[str, UpdateWindow] = {}

    def keep(window: UpdateWindow, _: Learner) -> None:
        seen["window"] = window

    with around_replay(body, keep):
        report = dist_update(
            learner, update, settings(microbatch=microbatch, contract=contract), placement=given
        )
    sync = backend.rendezvous
    info = {
        "version": report.version,
        "tree_retries": report.tree_retries,
        "window_resets": report.window_resets,
        "oom_splits": report.local.oom_splits,
        "dropped": [[d.index, d.reason] for d in report.dropped],
        "duplicated_tokens": seen["window"].placement.duplicated_tokens,
        "zero_stage": backend.zero_stage,
        "offload_optimizer": backend.offload_optimizer,
        "steps": report.local.steps,
        "rank_tokens": list(report.rank_tokens),
        "imbalance": report.imbalance,
        "rounds": sync.rounds if sync is not None else 0,
        "served": sync.served if sync is not None else 0,
        "param_peak_bytes": backend.param_peak_bytes,
        "param_sampled_bytes": sampled[0],
        "partition_bytes": sum(
            p.ds_tensor.numel() * p.ds_tensor.element_size()
            for p in backend.module.parameters()
            if getattr(p, "ds_tensor", None) is not None
        ),
    }
    return current(backend) - start, info


def no_rescale(stage_name: str) -> tuple[torch.Tensor, Info]:
    """Negative control: the backend's `x dp_world_size` before DeepSpeed's mean is left out."""

    def body(window: UpdateWindow, learner: Learner) -> None:
        learner.backend._scale_local_grads = lambda factor: None  # type: ignore[attr-defined]

    return one_update(stage_name, body=body)


# ----- faults ---------------------------------------------------------------------------------------
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

    def body(window: UpdateWindow, learner: Learner) -> None:
        first = next(learner.backend.module.parameters())

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if state["armed"]:
                state["armed"] = False
                raise RuntimeError("injected failure in the middle of backward")
            return grad

        first.register_hook(hook)

    return one_update(stage_name, body=body)


def duplicate(stage_name: str) -> tuple[torch.Tensor, Info]:
    refused: list[str] = []

    def after(window: UpdateWindow, learner: Learner) -> None:
        for work in window.work.values():
            try:
                window.claims.claim(window.keys(work))  # what a second replay of the tree claims first
            except DuplicateContributionError as exc:
                refused.append(str(exc))

    with around_replay(after=after):
        delta, info = one_update(stage_name)
    info["refused"] = refused
    return delta, info


def drop_group(stage_name: str) -> tuple[torch.Tensor, Info]:
    """Rank 1 can never finish group 1's tree: the group is dropped on every rank, group 0 is trained."""
    update = groups()
    victim = update[1].trees[0].id

    learners: list[Learner] = []

    def hook(phase: str, step: Any) -> None:
        replaying = learners[0].current_tree if learners else None
        if torch.distributed.get_rank() == 1 and phase == "forward" and replaying == victim:
            raise RuntimeError("injected persistent failure")

    def body(window: UpdateWindow, learner: Learner) -> None:
        learners[:] = [learner]

    return one_update(stage_name, step_hook=hook, body=body, placement="round_robin")


def store_at(backend: Any, version: int) -> ResidentStore:
    """A resident store for the backend's model at `version` (a resumed or a deliberately mismatched run)."""
    return ResidentStore(ResidentIdentity.of(backend.module, version=version))


# ----- refusals and negative controls -------------------------------------------------------------
def stale_and_version(stage_name: str) -> tuple[torch.Tensor, Info]:
    info: Info = {}
    backend = backend_for(stage_name)
    start = current(backend)
    mismatched = Learner(backend, store=store_at(backend, backend.rank))
    try:
        dist_update(mismatched, groups(), settings())
        info["version_mismatch"] = "not refused"
    except AgreementError as exc:
        info["version_mismatch"] = str(exc)
    learner = Learner(backend)
    tree = groups()[0].trees[0]
    key = ResidentKey(tree.id, 1, tree.nodes[1].id)
    old = learner.identity

    def after(window: UpdateWindow, learner: Learner) -> None:  # resident state held at the step
        learner.store.put(key, [(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))], old)

    with around_replay(after=after):
        dist_update(learner, groups(), settings())
    for name, identity in (("stale_old_identity", old), ("stale_new_identity", learner.identity)):
        try:
            learner.store.get(key, identity)
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

        def tamper(window: UpdateWindow, learner: Learner, case: str = case) -> UpdateWindow | None:
            if backend.rank != 1:
                return None
            mine = sorted(window.claims.covered)
            if case == "doubled":
                other = sorted(set(window.manifest.keys()) - set(mine))[0]
                keys = [*mine, other]
            else:
                keys = mine[1:]
            tampered = CoverageClaims(keys)
            tampered.claim(keys)
            tampered.commit(keys)
            return replace(window, claims=tampered)

        try:
            with around_replay(after=tamper):  # step 6, the collective check, runs on the tampered claims
                dist_update(Learner(backend), groups(), settings())
            info[case] = "not refused"
        except ManifestError as exc:
            info[case] = str(exc)
        backend.reset_window()
    return current(backend) - start, info


def bypass(stage_name: str, kind: str) -> tuple[torch.Tensor, Info]:
    """Numeric negative controls: rank 1 doubles or skips a tree behind the claims' back."""

    def body(window: UpdateWindow, learner: Learner) -> None:
        if learner.backend.rank != 1:
            return
        work = next(iter(window.work.values()))
        keys = window.keys(work)
        if kind == "double":  # replayed twice, claimed once: the update's own replay then skips it
            replayer = learner.replayer(window.plan, LOSS)
            assert isinstance(replayer, TreeReplay)
            for _ in range(2):
                replayer.accumulate(UpdateBatch((work,), window.manifest), window.schedule)
        window.claims.claim(keys)
        window.claims.commit(keys)

    return one_update(stage_name, body=body, placement="round_robin")


# ----- resume and export ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Distributed:
    backend: str
    zero_stage: int
    offload_optimizer: bool
    deepspeed_config: str | None = None
    context_parallel: int = 1


class Payload:
    """A class no checkpoint may contain: weights-only loading must refuse to unpickle it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("Payload unpickled: arbitrary code ran",))


def tampered_load(fresh: DeepSpeedBackend, ckpt: Path) -> str:
    """Rank 0 plants a `Payload` in a copy of the checkpoint; every rank's load must refuse it."""
    bad = ckpt.with_name(ckpt.name + "-tampered")
    if fresh.rank == 0:
        import shutil

        shutil.copytree(ckpt, bad)
        target = next((bad / "deepspeed").glob("*model_states.pt"))
        data = torch.load(target, weights_only=False)  # written by this test a moment ago
        data["payload"] = Payload()
        torch.save(data, target)
    fresh.barrier()
    try:
        fresh.load_checkpoint(bad)
        return "not refused"
    except CheckpointError as exc:
        return str(exc)


def resume(stage_name: str) -> tuple[torch.Tensor, Info]:
    """Step 1, checkpoint, step 2 (AdamW, whose moments the checkpoint must carry); then a fresh engine
    (built by `make_backend` from trainer-style settings) loads the checkpoint and redoes step 2."""
    ckpt, export = OUT / f"ckpt-{stage_name}", OUT / f"export-{stage_name}"
    backend = backend_for(stage_name, ADAMW)
    learner = Learner(backend)
    dist_update(learner, groups(0), settings())
    backend.save_checkpoint(ckpt, {"version": learner.version, "update": 1})
    backend.export_pretrained(export)
    after_one = current(backend)
    dist_update(learner, groups(1), settings())
    after_two = current(backend)

    stage, offload = STAGES[stage_name]
    fresh = make_backend(make_model(), ADAMW, Distributed("deepspeed", stage, offload))
    assert isinstance(fresh, DeepSpeedBackend)
    state = fresh.load_checkpoint(ckpt)
    loaded = current(fresh)
    dist_update(Learner(fresh, store=store_at(fresh, state["version"])), groups(1), settings())
    info: Info = {
        "loaded_equals_saved": bool(torch.equal(loaded, after_one)),
        "client_state": state,
        "resumed_vs_original": float((current(fresh) - after_two).norm()),
        "tampered": tampered_load(fresh, ckpt) if stage_name == "z2" else "",
    }
    if backend.rank == 0:
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
        info["export_equals_weights"] = bool(torch.equal(params_vector(exported), after_one))
        info["export_files"] = sorted(p.name for p in export.iterdir())
    return current(fresh) - after_two, info


# ----- DeepSpeed pitfalls with several backward calls per step --------------------------------------
def several_backward(stage_name: str, naive: bool = False) -> tuple[torch.Tensor, Info]:
    """Several backward calls per step: 3 on rank 0 and 1 on rank 1, the last micro-batch the largest.

    The naive control uses DeepSpeed as documented for one backward per step (engine.backward, then
    engine.step) with 2 micro-batches on each rank (uneven counts would deadlock it).
    """
    batches = pitfall_batches(4)
    rank = torch.distributed.get_rank()
    split = 2 if naive else 3
    mine = batches[:split] if rank == 0 else batches[split:]
    backend = backend_for(stage_name)
    start = current(backend)
    if naive:
        for ids in mine:
            backend.engine.backward(lm_loss(backend.module, ids) * backend.world_size)
        backend.engine.step()
    else:
        backend.begin_window()
        for ids in mine:
            backend.backward(lm_loss(backend.module, ids))
        backend.step()
    return current(backend) - start, {"backward_calls": len(mine)}


def shuffled(stage_name: str) -> tuple[torch.Tensor, Info]:
    """Each rank replays with its own microbatching (K)."""
    return one_update(stage_name, microbatch=1 + torch.distributed.get_rank(), placement="round_robin")


# ----- LoRA: only adapter parameters trainable, KL against the same model with adapters off ---------
def lora_backend(stage_name: str, optimizer: OptimizerConfig = OPTIMIZER) -> DeepSpeedBackend:
    stage, offload = STAGES[stage_name]
    return DeepSpeedBackend(
        make_lora_model(), zero_stage=stage, offload_optimizer=offload, optimizer=optimizer
    )  # fmt: skip


def lora_learner(backend: DeepSpeedBackend, version: int = 0) -> Learner:
    return Learner(backend, store=store_at(backend, version), ref_model=AdaptersOff(backend.module))


LORA_SETTINGS = settings(loss=LORA_LOSS)


def lora_update(stage_name: str) -> tuple[torch.Tensor, Info]:
    backend = lora_backend(stage_name)
    start = current(backend)
    report = dist_update(lora_learner(backend), groups(), LORA_SETTINGS)
    named = list(backend.module.named_parameters())
    info = {
        "version": report.version,
        "trainable": sorted(n for n, p in named if p.requires_grad),
        "frozen_with_grad": sorted(n for n, p in named if not p.requires_grad and p.grad is not None),
        "zero_stage": backend.zero_stage,
    }
    info["only_adapters"] = all(is_adapter_param(n) for n in info["trainable"])
    return current(backend) - start, info


def lora_resume(stage_name: str) -> tuple[torch.Tensor, Info]:
    """As `resume`, with adapters: step, checkpoint, step; a fresh engine loads and redoes the second step.
    Rank 0's `export_pretrained` writes the adapter (PEFT `save_pretrained`), checked on a fresh base."""
    ckpt, export = OUT / f"ckpt-lora-{stage_name}", OUT / f"export-lora-{stage_name}"
    backend = lora_backend(stage_name, ADAMW)
    learner = lora_learner(backend)
    dist_update(learner, groups(0), LORA_SETTINGS)
    backend.save_checkpoint(ckpt, {"version": learner.version, "update": 1})
    backend.export_pretrained(export)
    after_one = current(backend)
    dist_update(learner, groups(1), LORA_SETTINGS)
    after_two = current(backend)

    stage, offload = STAGES[stage_name]
    fresh = make_backend(make_lora_model(), ADAMW, Distributed("deepspeed", stage, offload))
    assert isinstance(fresh, DeepSpeedBackend)
    state = fresh.load_checkpoint(ckpt)
    loaded = current(fresh)
    dist_update(lora_learner(fresh, version=state["version"]), groups(1), LORA_SETTINGS)
    info: Info = {
        "loaded_equals_saved": bool(torch.equal(loaded, after_one)),
        "resumed_vs_original": float((current(fresh) - after_two).norm()),
        "moved": float((after_two - after_one).norm()),
    }
    if backend.rank == 0:
        from peft import PeftModel

        exported = PeftModel.from_pretrained(make_model(), str(export))
        info["export_equals_weights"] = bool(torch.equal(params_vector(exported), after_one))
        info["export_files"] = sorted(p.name for p in export.iterdir())
    return current(fresh) - after_two, info


def weight_sync(stage_name: str) -> tuple[torch.Tensor, Info]:
    """The weights an inference engine receives (`weight_buckets`, one small bucket at a time) against the
    gathered parameters, and the parameter storage on this rank while they stream."""
    from treetrain.rollout.engines.weight_buckets import weight_buckets

    backend = backend_for(stage_name)
    params = dict(backend.module.named_parameters())
    gathered = (
        deepspeed.zero.GatheredParameters(list(params.values())) if backend.zero_stage == 3 else nullcontext()
    )
    with gathered:
        reference = {name: p.detach().clone() for name, p in params.items()}
    peak, seen, equal = 0, set(), True
    for bucket in weight_buckets(backend.engine, bucket_bytes=1):  # a bucket per module
        copies = sum(t.numel() * t.element_size() for _, t in bucket) if backend.zero_stage == 3 else 0
        peak = max(peak, param_storage(backend) + copies)  # under ZeRO-3 a bucket holds gathered copies
        for name, tensor in bucket:
            seen.add(name)
            equal = equal and torch.equal(tensor, reference[name])
    full = sum(t.numel() * t.element_size() for t in reference.values())
    info = {"equal": equal, "names": sorted(seen) == sorted(reference), "peak": peak, "full": full,
            "largest": 4 * largest_module(make_model())}  # fmt: skip
    return current(backend) * 0, info


def gathered_feed(lora: bool = False) -> tuple[torch.Tensor, Info]:
    """An asynchronous `hf` run's ZeRO-3 feed: rank 0's shadow, filled module by module by both ranks'
    gathers, against the gathered parameters (with `lora`, a PEFT model's base and adapter weights); rank 1
    keeps none."""
    import pickle

    from treetrain.rollout.gathered_feed import GatheredFeed

    backend = lora_backend("z3") if lora else backend_for("z3")
    backend.begin_window()  # a step first: ZeRO-3 adds more bookkeeping to the modules once they ran
    backend.backward(lm_loss(backend.module, pitfall_batches(1)[0]))
    backend.step()
    params = dict(backend.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        reference = {name: p.detach().clone() for name, p in params.items()}
    feed = GatheredFeed(backend.module, version=0, holds=backend.rank == 0)
    before = param_storage(backend)
    feed.publish(backend.module, version=1)
    info: Info = {"holds": feed.shadow is not None, "released": param_storage(backend) == before}
    if feed.shadow is not None:
        shadow = dict(feed.shadow.named_parameters())
        info["names"] = sorted(shadow) == sorted(reference)
        info["equal"] = all(torch.equal(shadow[n], t) for n, t in reference.items())
        info["own_storage"] = not any(
            shadow[n].untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
            for n, p in params.items()
        )
        info["shared"] = all(p.is_shared() and p.device.type == "cpu" for p in shadow.values())
        info["pickles"] = b"deepspeed" not in pickle.dumps(feed.shadow)  # the module the sampler receives
    return current(backend) * 0, info


def scenarios() -> dict[str, Callable[[], tuple[torch.Tensor, Info]]]:
    out: dict[str, Callable[[], tuple[torch.Tensor, Info]]] = {}
    for s in STAGES:
        placement = "round_robin" if s in ("z1", "z3") else "planner"
        out[f"{s}-exact"] = partial(one_update, s, placement=placement)
        out[f"{s}-response_only"] = partial(one_update, s, "response_only", placement=placement)
        out[f"{s}-adamw"] = partial(one_update, s, placement=placement, optimizer=ADAMW)
        out[f"{s}-no_rescale"] = partial(no_rescale, s)
    for family in RECURRENT_DIST:  # recurrent resident state; round-robin splits every tree over both ranks
        for s in ("z0", "z1", "z2", "z3"):
            out[f"{s}-exact-{family}"] = partial(
                one_update, s, placement="round_robin", measure=s == "z3", family=family
            )
        out[f"z3-response_only-{family}"] = partial(
            one_update, "z3", "response_only", placement="round_robin", family=family
        )
    out["z3-calibrate-qwen3_5_text"] = partial(fresh_calibration, "qwen3_5_text")
    for s in ("z2", "z3"):
        out[f"{s}-fault_before_backward"] = partial(
            one_update, s, step_hook=Once(0, "forward", RuntimeError("injected before backward")),
            placement="round_robin",
        )  # fmt: skip
        out[f"{s}-fault_after_backward_started"] = partial(
            one_update, s, step_hook=Once(1, "backward", RuntimeError("injected after a backward"), nth=2),
            placement="round_robin",
        )  # fmt: skip
        out[f"{s}-fault_mid_backward"] = partial(mid_backward, s)
        out[f"{s}-oom"] = partial(one_update, s, step_hook=MultiUnitOOM(), placement="round_robin")
        out[f"{s}-duplicate"] = partial(duplicate, s)
        out[f"{s}-order"] = partial(shuffled, s)
    out["z2-drop_group"] = partial(drop_group, "z2")
    out["z2-stale"] = partial(stale_and_version, "z2")
    out["z2-coverage"] = partial(coverage_controls, "z2")
    out["z2-double"] = partial(bypass, "z2", "double")
    out["z2-skip"] = partial(bypass, "z2", "skip")
    for s in ("z2", "z3", "z2off"):
        out[f"{s}-resume"] = partial(resume, s)
    for s in ("z1", "z2", "z2off", "z3"):
        out[f"{s}-several_backward"] = partial(several_backward, s)
    out["z1-several_backward_naive"] = partial(several_backward, "z1", naive=True)
    for s in ("z0", "z1", "z2", "z3"):
        out[f"{s}-lora"] = partial(lora_update, s)
    for s in ("z2", "z3"):
        out[f"{s}-lora_resume"] = partial(lora_resume, s)
    for s in ("z2", "z3"):
        out[f"{s}-weight_sync"] = partial(weight_sync, s)
    out["z3-gathered_feed"] = gathered_feed
    out["z3-gathered_feed_lora"] = partial(gathered_feed, lora=True)
    for s in ("z1", "z2", "z3"):  # rank 0: one small tree, rank 1: five large; then rank 1 idle
        out[f"{s}-uneven"] = partial(one_update, s, placement="uneven", update=uneven_groups(), measure=True)
        out[f"{s}-idle"] = partial(one_update, s, placement="idle", measure=True)
    return out


FRESH_PROBES = (Probe(5, 2, (2, 2, 2), 5, 3), Probe(1008, 0, (2,), 16, 2, chunk=256))
"""Single-token steps after a recurrent past, and a long prompt in chunks that hand their state on: two of
the calibration's probes (`calibration_probes.probes_for`), which each fail without the held weights as
the whole set does, in a sixth of its time."""


def fresh_calibration(family: str) -> tuple[None, Info]:
    """The memory calibration measured under ZeRO-3 itself (not lent from an unpartitioned twin): a
    recurrent mixer reads its convolution weight directly, also in its one-token steps."""
    backend = backend_for("z3", family=family)
    with backend.scratch():
        model = calibrate(backend.module, "exact", cache=False, probes=FRESH_PROBES)
    return None, {"samples": model.samples, "held": len(backend._direct.params) if backend._direct else 0}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    for name, run in scenarios().items():
        if (ONLY is not None and name not in ONLY) or (OUT / f"{name}.json").exists():
            continue  # a relaunch after a crash runs only what the crashed launch had not finished
        delta: torch.Tensor | None = None
        started = time.monotonic()
        try:
            delta, info = run()
            info["seconds"] = round(time.monotonic() - started, 2)
        except Exception:
            (OUT / f"{name}.error.rank{rank}.txt").write_text(traceback.format_exc())
            info = {"error": traceback.format_exc(limit=2)}
        infos: list[Any] = [None] * torch.distributed.get_world_size()
        gc.collect()  # the scenario's engines and their process groups go now, on both ranks alike
        torch.distributed.all_gather_object(infos, info)  # trusted peers: the ranks of this test
        if rank == 0:
            if delta is not None:
                save_file({"delta": delta.contiguous()}, str(OUT / f"{name}.safetensors"))
            part = OUT / f"{name}.json.part"
            part.write_text(json.dumps({"ranks": infos}))
            part.replace(OUT / f"{name}.json")  # its presence says the scenario is done
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
