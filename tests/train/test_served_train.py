"""`treetrain train --set rollout.engine=vllm-server` end to end against a real `vllm serve` (the docs'
command, the session's server): two updates with a reload before each, a SIGKILL after the first
checkpoint and `--resume`, and every update's samples from the trainer's current weights (the
sampler/trainer gap at float32 rounding; `tests/rollout/test_served_engine.py` holds the negative control,
a skipped reload, whose gap is large)."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest
from support.staleness_checks import queued_lags, within
from support.train_cases import kill_after_first_checkpoint, train_process

from treetrain.train.metrics import read_metrics

SETTINGS = [
    "rollout.engine=vllm-server", "model.path=demo-wide", "updates=2", "checkpoint_every=1", "threads=1",
    "rollout.groups_per_update=2", "rollout.fanout.root=4", "measure_memory_every=0",
]  # fmt: skip
GAP = 1e-4
"""Largest |logp_trainer - logp_vllm| on a policy token when both hold the same float32 weights."""


def _train(run: Path, url: str, *extra: str) -> subprocess.Popen[str]:
    return train_process(run, [*SETTINGS, f"rollout.vllm.urls=[{json.dumps(url)}]"], *extra)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_training_against_a_server_survives_a_kill_and_resumes(vllm_server: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _train(run, vllm_server)
    kill_after_first_checkpoint(proc, run, 300)
    done_before = len(read_metrics(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else 0
    assert done_before < 2

    resumed = _train(run, vllm_server, "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m.update for m in metrics] == [0, 1]
    assert [m.version for m in metrics] == [1, 2]
    for m in metrics:  # each update sampled with the weights it trained: reloaded after every step and resume
        assert m.sampler_logprob_gap_max is not None and m.sampler_logprob_gap_max < GAP, m
    with urllib.request.urlopen(vllm_server + "/weight_info", timeout=30) as resp:
        label = json.loads(resp.read())["weight_version"]
    assert label == f"{(run / 'engine-weights').resolve()}@1"  # the last sync, before update 1
    assert not (run / "engine-weights").exists()  # the copy written for the server goes with the run's end


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_asynchronous_training_against_a_server(vllm_server: str, tmp_path: Path) -> None:
    """`rollout.max_staleness=1`: the sampler thread sends requests and reloads the server while the trainer
    steps; every token is within one version of its update's (read from the tree files), and the lag-0 part
    of the gap is float32 rounding: the server held the weights it said it held."""
    run = tmp_path / "run"
    proc = _train(run, vllm_server, "--set", "rollout.max_staleness=1")
    _, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, err[-3000:]
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m.update for m in metrics] == [0, 1]
    assert within(queued_lags(run, metrics), 1)
    fresh = [row for m in metrics for row in m.sampler_gap_by_lag if row[0] == 0]
    assert fresh and all(largest < GAP for _, _, largest, _ in fresh)
    assert any(lag == 1 for m in metrics for lag, *_ in m.sampler_gap_by_lag)
    assert not (run / "engine-weights").exists()
