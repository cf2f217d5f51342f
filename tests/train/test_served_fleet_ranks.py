"""A fleet of two real `vllm serve` processes (the docs' command, the session's servers) feeding two trainer
ranks (`torchrun`, gloo, DeepSpeed ZeRO-3), synchronously (K = 0) and asynchronously
(`rollout.max_staleness=1`, one server killed with SIGKILL once the first update is trained).

At K = 0 each rank is a client of the fleet and samples its own share of the tasks; rank 0 streams the
weights into every server through vLLM's weight-transfer API (`rollout.vllm.weight_sync=gloo`), one bucket
at a time from the gathered modules, and rank 1 follows (`treetrain.rollout.engines.server_ranks`). The run makes the single-process updates: one process
trains the trees the two ranks sampled (`rollout.trees` over their `rollouts/`), with SGD, and the weight
deltas agree to fp32 reduction order (`support.two_nodes.close_delta`, whose negative control is a halved
update).

At K = 1 (weights through files) every rank publishes each version on its training thread (the gathers of ZeRO-3, one bucket at a
time), rank 0 writes it, and rank 0's sampler thread has the servers load it while the trainer steps
(`treetrain.rollout.served_feed`). The kill is routed around: the run goes on at the other server, counts
the loss and names it in one line. Every update is trained once, every token is within one version of its
update's (read from the tree files); the held-out evaluations run on rank 0 alone, the other rank sampling
none.

In both, the lag-0 sampler/trainer gap is float32 rounding, so the servers held the weights they said they
held (`tests/rollout/test_served_engine.py` holds the negative control, weights published and not loaded,
whose gap is large). The K = 0 test comes first: the K = 1 test kills the second server.

A third run kills the whole trainer (torchrun and both ranks, SIGKILL) mid-run at K = 1 on the first server,
gives that server other weights, and resumes: every update once, and the resumed run's samples come from the
checkpoint's weights."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from support.ports import stalling_ranks, train_ranks
from support.staleness_checks import queued_lags, within
from support.two_nodes import close_delta, delta, weights
from transformers import AutoModelForCausalLM

from treetrain.cli.main import main
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.server_checks import Expected
from treetrain.rollout.engines.vllm_server import VLLMServerEngine
from treetrain.rollout.sources.tree_queue import queued_marker
from treetrain.train.metrics import read_evals, read_metrics

WIDE = Path(__file__).resolve().parents[2] / "treetrain" / "assets" / "demo_model_wide" / "model.safetensors"
GAP = 1e-4
"""Largest |logp_trainer - logp_vllm| on a policy token when both hold the same float32 weights."""
FLEET = ["model.path=demo-wide", "checkpoint_every=0", "threads=1", "measure_memory_every=0",
         "rollout.groups_per_update=2", "rollout.fanout.root=4"]  # fmt: skip
TRAINING = [*FLEET, "updates=2", "optim.name=sgd", "optim.lr=0.05"]
RANKS = ["rollout.engine=vllm-server", "distributed.backend=deepspeed", "distributed.zero_stage=3"]
ASYNC = [*FLEET, *RANKS, "updates=4", "rollout.max_staleness=1", "eval.every=2", "eval.tasks=3"]


def _kill_after_first_update(run: Path, served: Any, killed: threading.Event, stop: threading.Event) -> None:
    """SIGKILL `served` (the server and its engine core) once `metrics.jsonl` has its first row."""
    metrics = run / "metrics.jsonl"
    while not stop.is_set():
        if metrics.exists() and read_metrics(metrics):  # an update's row, not the evaluation's before it
            served.kill()
            killed.set()
            return
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_two_zero3_ranks_sample_from_two_servers_and_make_the_single_process_updates(
    vllm_server: str, second_vllm_server: Any, tmp_path: Path
) -> None:
    run, single = tmp_path / "run", tmp_path / "single"
    urls = [vllm_server, second_vllm_server.base]
    streamed = [f"rollout.vllm.urls={json.dumps(urls)}", "rollout.vllm.weight_sync=gloo"]
    done = train_ranks(run, [*TRAINING, *RANKS, *streamed], timeout=800)
    assert done.returncode == 0, done.output[-4000:]

    metrics = read_metrics(run / "metrics.jsonl")
    assert [m.update for m in metrics] == [0, 1]  # an update whose groups all tie takes no step
    assert all(m.trajectories == 8 for m in metrics)  # both ranks' tasks, every update
    trained = [m for m in metrics if m.groups > m.groups_dropped]
    assert trained, "no group trained: the comparison below would be vacuous"
    for m in trained:  # each update sampled with the weights it trained
        assert m.sampler_logprob_gap_max is not None and m.sampler_logprob_gap_max < GAP, m
    one_copy = WIDE.stat().st_size
    for m in metrics:  # streamed once per sync and server, by rank 0 (two senders would be twice that)
        assert 2 * one_copy * 0.9 <= m.weight_sync_bytes < 2 * one_copy * 1.1, (m.weight_sync_bytes, one_copy)
        requests = {url: n for url, n, *_ in m.servers}  # rank r's client starts at server r: both serve
        assert set(requests) == set(urls) and all(requests.values()), m.servers
    for update in (0, 1):  # rank 0 sampled task 0 and rank 1 task 1, each through the fleet
        assert len(list((run / "rollouts" / f"update-{update:05d}").rglob("*.msgpack"))) == 2
    for url in urls:  # every server holds rank 0's last sync, made before update 1
        with urllib.request.urlopen(url + "/weight_info", timeout=30) as resp:
            label = json.loads(resp.read())["weight_version"]
        assert label == f"{(run / 'engine-weights').resolve()}@{metrics[0].version}", url
    assert not (run / "engine-weights").exists()  # nothing is written

    recorded = [a for kv in [*TRAINING, f"rollout.trees={run / 'rollouts'}"] for a in ("--set", kv)]
    assert main(["train", "--run-dir", str(single), "--no-progress", *recorded]) == 0
    start = weights(WIDE)
    want = weights(single / "final" / "model.safetensors")
    start = {k: v for k, v in start.items() if k in want}
    got = weights(run / "final" / "model.safetensors")
    close_delta(delta(start, got), delta(start, want), "2 ZeRO-3 ranks on two servers, 2 updates")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_two_zero3_ranks_train_asynchronously_from_two_servers_one_killed(
    vllm_server: str, second_vllm_server: Any, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    urls = [second_vllm_server.base, vllm_server]
    killed, stop = threading.Event(), threading.Event()
    killer = threading.Thread(target=_kill_after_first_update, args=(run, second_vllm_server, killed, stop))
    killer.start()
    try:
        done = train_ranks(run, [*ASYNC, f"rollout.vllm.urls={json.dumps(urls)}"], timeout=1000)
    finally:
        stop.set()
        killer.join()
    assert done.returncode == 0, done.output[-4000:]
    assert killed.is_set()

    metrics = read_metrics(run / "metrics.jsonl")
    versions = [m.version for m in metrics]  # an update whose groups all had equal rewards takes no step
    assert [m.update for m in metrics] == [0, 1, 2, 3] and versions == sorted(versions) and versions[-1] >= 2
    assert all(m.trajectories == 8 for m in metrics)
    assert within(queued_lags(run, metrics), 1)
    fresh = [row for m in metrics for row in m.sampler_gap_by_lag if row[0] == 0]
    assert fresh and all(largest < GAP for _, _, largest, _ in fresh), fresh
    assert any(lag == 1 for m in metrics for lag, *_ in m.sampler_gap_by_lag)  # it did run ahead

    assert sum(m.servers_lost for m in metrics) == 1, [m.servers_lost for m in metrics]
    assert f"vllm-server {second_vllm_server.base} is lost" in done.output
    last = {url: requests for url, requests, *_ in metrics[-1].servers}
    assert last.get(vllm_server, 0) > 0 and last.get(second_vllm_server.base, 0) == 0  # routed around
    one_copy = WIDE.stat().st_size
    assert one_copy * 0.9 <= metrics[0].weight_sync_bytes < one_copy * 1.5  # rank 0's files, one copy a sync
    assert all(m.weight_sync_bytes < one_copy * 3.5 for m in metrics)  # a sync before and during a rollout
    trained_at = [0, *versions[:-1]]
    for i, m in enumerate(
        metrics[1:], start=1
    ):  # the publish after the previous update's step, if it took one
        assert (m.weight_publish_seconds > 0.01) == (versions[i - 1] > trained_at[i - 1]), m
    for update in range(4):  # rank 0 sampled every task; the trees reached rank 1 through the gather
        out = run / "rollouts" / f"update-{update:05d}"
        assert queued_marker(out, 0).exists() and not queued_marker(out, 1).exists()
    evals = read_evals(run / "metrics.jsonl")  # rank 0 sampled every held-out task, on the live server
    assert [e.update for e in evals] == [0, 2, 4] and all(e.tasks == 3 and not e.failed_tasks for e in evals)
    assert not (run / "engine-weights").exists()  # what rank 0 published went with the run's end


def _serve_other_weights(url: str, weights_dir: Path) -> None:
    """Have the server at `url` load the demo model moved off its weights (a sampled token's logprob then
    differs from the trainer's by far more than GAP), labelled as another run's version."""
    other = AutoModelForCausalLM.from_pretrained(WIDE.parent, dtype=torch.float32)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    want = Expected(str(WIDE.parent), "float32", 1024)
    engine = VLLMServerEngine(VLLMSettings(urls=(url,)), weights_dir=weights_dir, expected=want)
    try:
        engine.sync_weights(other, 99)
    finally:
        engine.close()
    with urllib.request.urlopen(url + "/weight_info", timeout=30) as resp:
        assert json.loads(resp.read())["weight_version"].endswith("@99")


def _start_and_kill_at(run: Path, settings: list[str], point: str, after: Path, tmp_path: Path) -> str:
    """Start the two ranks under torchrun (the rank named in `point` stands still there), and once `after`
    exists too, SIGKILL torchrun and every process below it, as a lost machine; torchrun's output."""
    arrived, log = tmp_path / "arrived", tmp_path / "killed.log"
    args = ["train", "--run-dir", str(run), "--no-progress", *(a for kv in settings for a in ("--set", kv))]
    with stalling_ranks(point, arrived, args, log, wait=(after,), timeout=600):
        time.sleep(1.0)
    return log.read_text()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_two_zero3_ranks_killed_mid_run_resume_asynchronously_with_every_update_once(
    vllm_server: str, tmp_path: Path
) -> None:
    """kill -9 of the whole trainer (torchrun and both ranks) with update 0 trained and checkpointed and
    rank 0's sampler thread inside update 1's rollout, then `--resume` under torchrun: every update is
    trained once with all of its trajectories and every token within one version of its update's. The
    resumed run samples update 1 itself, at the checkpoint's version, and trains it at that version (lag 0).
    Before the resume the server is given other weights (as another run would leave it), so that lag-0
    gap at rounding shows the resumed run set the server to the checkpoint's weights before it sampled."""
    run = tmp_path / "run"
    settings = [*FLEET, *RANKS, "updates=3", "rollout.max_staleness=1", "checkpoint_every=1",
                f"rollout.vllm.urls={json.dumps([vllm_server])}"]  # fmt: skip
    checkpoint = run / "checkpoints" / "update-00001"
    output = _start_and_kill_at(run, settings, "rollout-start@1#0", checkpoint, tmp_path)
    assert [m.update for m in read_metrics(run / "metrics.jsonl")] == [0], output[-3000:]

    _serve_other_weights(vllm_server, tmp_path / "other")
    done = train_ranks(run, settings, "--resume", timeout=800)
    assert done.returncode == 0, done.output[-4000:]
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m.update for m in metrics] == [0, 1, 2], "an update was lost or trained twice"
    assert all(m.trajectories == 8 for m in metrics)
    versions = [m.version for m in metrics]
    assert versions == sorted(versions)
    assert within(queued_lags(run, metrics), 1)
    fresh = [row for m in metrics[1:] for row in m.sampler_gap_by_lag if row[0] == 0]
    assert fresh and all(largest < GAP for _, _, largest, _ in fresh), fresh
    assert not (run / "engine-weights").exists()
