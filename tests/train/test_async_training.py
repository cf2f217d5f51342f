"""Asynchronous training (`rollout.max_staleness=1`) end to end with the `hf` engine: the sampler runs
ahead, every trained token's version lag is within the bound (checked token by token from the tree files),
and kill -9 at any point followed by `--resume` trains each update's trees exactly once.

Negative control: a sampler allowed to run K + 1 ahead (`AsyncRolloutSource.pace`) samples tokens over the
bound; the check of this file finds them in the queued trees, and the trainer drops their groups and counts
their tokens instead of training on them."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from support.gated_env import wait_for
from support.processes import alive, descendants, name
from support.staleness_checks import queued_lags, split_turns, within
from support.stalling_train import start_stalling

from treetrain.cli.main import main
from treetrain.errors import ConfigError
from treetrain.rollout.engines.hf_process import PROCESS_NAME
from treetrain.rollout.sources.async_source import AsyncRolloutSource
from treetrain.rollout.sources.tree_queue import queued_marker, read_queued
from treetrain.train.config import load_config
from treetrain.train.loop import Trainer
from treetrain.train.metrics import read_evals, read_metrics

pytestmark = pytest.mark.launch  # end-to-end runs: each starts its environment worker processes

K = 1
UPDATES = 4
GROUPS, FANOUT = 2, 4
SETTINGS = [
    "model.path=tiny-llama", f"rollout.groups_per_update={GROUPS}", f"rollout.fanout.root={FANOUT}",
    "rollout.episode.max_turns=2", "rollout.episode.max_turn_tokens=12", "optim.lr=0.01",
    "advantages.zero_variance=keep", "measure_memory_every=0", "threads=1", f"updates={UPDATES}",
    f"rollout.max_staleness={K}", "checkpoint_every=1",
]  # fmt: skip


def _trainer(run: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*SETTINGS, f"run_dir={run}", *extra]), progress=False)


def _hold_publish(source: AsyncRolloutSource, until: int) -> None:
    """Make update 0's step wait to publish its weights until the sampler has queued update `until`: what
    the sampler samples meanwhile is of version 0, whatever the machine's timing."""
    publish = source.trained

    def trained(update: int, model: Any, version: int) -> None:
        if update == 0:
            assert wait_for(lambda: until in source._ready, 300), "the sampler never ran ahead"
        publish(update, model, version)

    source.trained = trained  # type: ignore[method-assign]


def test_the_sampler_runs_ahead_and_every_token_is_within_the_bound(tmp_path: Path) -> None:
    run = tmp_path / "run"
    threads = torch.get_num_threads()
    try:  # held-out evaluation samples on the sampler's engine between two of its updates
        trainer = _trainer(run, "eval.every=2", "eval.tasks=2")
        assert isinstance(trainer.source, AsyncRolloutSource)
        assert trainer.cfg.loss.sampler_correction == "token_truncate"  # K >= 1: decoupled PPO by default
        _hold_publish(trainer.source, until=1)
        trainer.run()
    finally:
        torch.set_num_threads(threads)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r.update for r in rows] == list(range(UPDATES)) and [r.version for r in rows] == [1, 2, 3, 4]
    lags = queued_lags(run, rows)
    assert within(lags, K), lags
    assert lags[1].histogram == ((1, lags[1].tokens),)  # update 1 was sampled while update 0 trained
    for row in rows:  # the metrics say what the files say
        assert (row.staleness_min, row.staleness_max) == (lags[row.update].least, lags[row.update].most)
        assert row.staleness_mean == pytest.approx(lags[row.update].mean)
        assert row.stale_tokens_dropped == 0 and row.trajectories == GROUPS * FANOUT
        assert split_turns(run, row.update) <= row.samples_interrupted  # each split turn was interrupted
    assert sum(r.trajectories for r in rows) == UPDATES * GROUPS * FANOUT
    assert [(e.update, e.version) for e in read_evals(run / "metrics.jsonl")] == [(0, 0), (2, 2), (4, 4)]


def test_a_sampler_running_past_the_bound_is_caught(tmp_path: Path) -> None:
    """Negative control: pace K + 1 puts update 2's tokens two versions behind; the check of the queued
    files flags them, and the trainer dropped their groups (counted) instead of training on them."""
    run = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        trainer = _trainer(run, "updates=3")
        assert isinstance(trainer.source, AsyncRolloutSource)
        trainer.source.pace = K + 1
        _hold_publish(trainer.source, until=2)
        trainer.run()
    finally:
        torch.set_num_threads(threads)
    rows = read_metrics(run / "metrics.jsonl")
    lags = queued_lags(run, rows)
    assert not within(lags, K) and lags[2].most == K + 1
    assert rows[2].stale_tokens_dropped == lags[2].tokens and rows[2].groups_dropped == GROUPS
    assert all(r.staleness_max is None or r.staleness_max <= K for r in rows)  # nothing over K was trained


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "point", ["rollout-start@2", "rollout-queued@2", "update-start@1", "checkpoint-write@2"]
)  # fmt: skip
def test_kill_9_anywhere_then_resume_trains_each_update_once(tmp_path: Path, point: str, capsys) -> None:
    """Mid-rollout, with finished trees queued, once an update took its trees (mid-step), and inside a
    checkpoint write: after --resume every update is trained once, with every token within the bound, and
    no process of the killed run (environment workers, the sampler process) is left."""
    run = tmp_path / "run"
    args = ["train", "--run-dir", str(run), "--no-progress", *(a for kv in SETTINGS for a in ("--set", kv))]
    proc = start_stalling(args, point, tmp_path / "arrived")
    kids = descendants(proc.pid)
    assert any(name(k) == PROCESS_NAME for k in kids), "the run has no sampler process"
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert wait_for(lambda: not any(alive(k) for k in kids), 30), "a process outlived the run"
    checkpoints = (
        [int(p.name[7:]) for p in (run / "checkpoints").glob("update-*")]
        if (run / "checkpoints").is_dir()
        else []
    )
    resumed_at = max(checkpoints, default=0)  # every update steps, so this is also the resumed version
    queued = {}  # update -> (marker text, newest version among its tokens), as the killed run left them
    for marker in (run / "rollouts").glob("*/queued-rank0.json"):
        update = int(marker.parent.name.split("-")[1])
        trees = read_queued(run, update).trees
        queued[update] = (marker.read_text(), max(v for t in trees for vs in t.node_versions for v in vs))
    threads = torch.get_num_threads()
    try:
        assert main([*args, "--resume"]) == 0, capsys.readouterr().err[-3000:]
    finally:
        torch.set_num_threads(threads)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r.update for r in rows] == list(range(UPDATES)), "an update was lost or trained twice"
    assert [r.version for r in rows] == [1, 2, 3, 4]
    lags = queued_lags(run, rows)
    assert within(lags, K), lags
    assert sum(r.trajectories for r in rows) == UPDATES * GROUPS * FANOUT  # none lost, none doubled
    for update, (text, newest) in queued.items():  # kept in the run directory when still within reach
        if update >= resumed_at:
            kept = newest <= resumed_at
            assert (rows[update].rollout_seconds == 0.0) == kept, (update, newest, resumed_at)
            assert (
                queued_marker(run / "rollouts" / f"update-{update:05d}", 0).read_text() == text
            ) or not kept


def test_time_is_reported_for_both_sides(tmp_path: Path) -> None:
    """A synchronous run's trainer waits for the whole rollout; the sampler never waits."""
    run = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        _trainer(run, "rollout.max_staleness=0", "updates=1").run()
    finally:
        torch.set_num_threads(threads)
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row.trainer_idle_seconds == row.rollout_seconds > 0 and row.sampler_idle_seconds == 0
    assert (row.staleness_min, row.staleness_max, row.queue_depth) == (0, 0, 0)


def test_zero3_is_refused_asynchronously_where_every_rank_would_hold_the_whole_model() -> None:
    """Under ZeRO-3 no rank holds the whole policy: in-process vLLM, which loads the weights on every rank,
    is refused in one line naming the engines that need no copy there; `vllm-server` (its servers hold the
    weights) and `hf` (one sampler process on rank 0, `test_async_distributed.py` trains it) are taken."""
    zero3 = ["distributed.backend=deepspeed", "distributed.zero_stage=3", "rollout.max_staleness=1"]
    with pytest.raises(
        ConfigError, match=r"^rollout.max_staleness: with rollout.engine='vllm' .*'vllm-server'.*'hf'"
    ):
        load_config(None, [*zero3, "rollout.engine=vllm"])
    load_config(None, [*zero3, "rollout.engine=vllm-server", "rollout.vllm.urls=['http://127.0.0.1:1']"])
    load_config(None, [*zero3, "rollout.engine=hf"])
    load_config(None, [*zero3[:1], "distributed.zero_stage=2", zero3[2], "rollout.engine=vllm"])
