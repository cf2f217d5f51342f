"""An asynchronous `hf` run spawns its sampler process before the trainer loads its model, so the sampler's
imports overlap the trainer's start instead of delaying the first rollout; the engine takes that process,
and one no engine took is closed with the trainer."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from support.gated_env import wait_for
from support.processes import alive, descendants

import treetrain.rollout.sources.sampler_start as sampler_start
import treetrain.train.loop as loop_module
from treetrain.rollout.engines.hf_process import HFProcessEngine
from treetrain.rollout.engines.sampler_process import fork_is_safe
from treetrain.rollout.sources.async_source import AsyncRolloutSource
from treetrain.rollout.sources.sampler_start import early_sampler, needs_sampler_process
from treetrain.train.config import load_config
from treetrain.train.loop import Trainer

SETTINGS = ["model.path=tiny-llama", "rollout.groups_per_update=1", "rollout.fanout.root=2", "threads=1",
            "measure_memory_every=0", "updates=1"]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "needed"),
    [
        ([], False),
        (["rollout.max_staleness=1"], True),
        (["rollout.max_staleness=2"], True),
        (["rollout.max_staleness=1", "rollout.engine=vllm"], False),
        (
            [
                "rollout.max_staleness=1",
                "rollout.engine=vllm-server",
                'rollout.vllm.urls=["http://127.0.0.1:1"]',
            ],
            False,
        ),
    ],
)
def test_only_an_asynchronous_hf_run_needs_a_sampler_process(extra: list[str], needed: bool) -> None:
    assert needs_sampler_process(load_config(None, [*SETTINGS, *extra])) is needed


def test_under_zero3_only_rank_0_starts_a_sampler_process() -> None:
    """ZeRO-3 affords one shadow of the policy: rank 0's `hf` process samples every task."""
    zero3 = ["rollout.max_staleness=1", "distributed.backend=deepspeed", "distributed.zero_stage=3"]
    cfg = load_config(None, [*SETTINGS, *zero3])
    assert [needs_sampler_process(cfg, rank) for rank in (0, 1, 2)] == [True, False, False]
    zero2 = load_config(None, [*SETTINGS, *zero3[:2], "distributed.zero_stage=2"])
    assert [needs_sampler_process(zero2, rank) for rank in (0, 1)] == [True, True]


def _spying_on_load(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The child processes this process has at each call of `load_models` (the model's load)."""
    seen: list[set[int]] = []
    load = loop_module.load_models

    def spied(*args: Any, **kwargs: Any) -> Any:
        seen.append(descendants(os.getpid()))
        return load(*args, **kwargs)

    monkeypatch.setattr(loop_module, "load_models", spied)
    return seen


@pytest.mark.launch  # starts a sampler process and environment workers
@pytest.mark.parametrize("staleness", [1, 0])
def test_the_sampler_process_runs_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staleness: int
) -> None:
    """K = 1: the process the engine samples in already ran when the model began to load. K = 0 (the
    negative control of the spy): no sampler process, nothing of the kind."""
    seen = _spying_on_load(monkeypatch)
    before = descendants(os.getpid())
    threads = torch.get_num_threads()
    cfg = load_config(None, [*SETTINGS, f"rollout.max_staleness={staleness}", f"run_dir={tmp_path / 'run'}"])
    trainer = Trainer(cfg, progress=False)
    try:
        (at_load,) = seen
        if staleness:
            assert isinstance(trainer.source, AsyncRolloutSource)
            engine = trainer.source.engine
            assert isinstance(engine, HFProcessEngine) and engine.pid in at_load - before
            assert (
                trainer.sampler is not None and trainer.sampler.adopted and trainer.sampler.pid == engine.pid
            )
        else:
            assert trainer.sampler is None and not isinstance(trainer.source, AsyncRolloutSource)
    finally:
        trainer.close()
        torch.set_num_threads(threads)


@pytest.mark.launch
def test_a_sampler_process_no_engine_took_ends_with_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model fails to load: the trainer refuses, and the process spawned for its sampler is gone."""
    seen = _spying_on_load(monkeypatch)

    def broken(*args: Any, **kwargs: Any) -> Any:
        seen.append(descendants(os.getpid()))
        raise OSError("the checkpoint cannot be read")

    monkeypatch.setattr(loop_module, "load_models", broken)
    before = descendants(os.getpid())
    cfg = load_config(None, [*SETTINGS, "rollout.max_staleness=1", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(OSError, match="cannot be read"):
        Trainer(cfg, progress=False)
    (at_load,) = seen
    spawned = at_load - before
    assert spawned, "no sampler process ran while the model loaded"
    assert wait_for(lambda: not any(alive(p) for p in spawned), 30), (
        "the sampler process outlived the trainer"
    )


def test_a_fresh_process_without_cuda_forks_its_sampler_and_any_other_spawns_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`treetrain train` (fresh) forks where that is safe: the fork has every module already, no 5 s of
    imports. The Python API's trainer, which may have computed before, spawns."""
    cfg = load_config(None, [*SETTINGS, "rollout.max_staleness=1"])
    monkeypatch.setattr(sampler_start, "SamplerProcess", lambda method: method)
    monkeypatch.setattr(sampler_start, "fork_is_safe", lambda: True)
    assert early_sampler(cfg, fresh=True) == "fork" and early_sampler(cfg) == "spawn"
    monkeypatch.setattr(sampler_start, "fork_is_safe", lambda: False)
    assert early_sampler(cfg, fresh=True) == "spawn"
    assert early_sampler(load_config(None, SETTINGS), fresh=True) is None  # K = 0: no sampler process


def test_a_fork_is_unsafe_beside_another_thread_or_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not fork_is_safe()
    finally:
        stop.set()
        other.join()
    if threading.active_count() == 1:  # the case `treetrain train` is in; under xdist a worker has more
        assert fork_is_safe()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert not fork_is_safe()
