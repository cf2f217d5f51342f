"""`treetrain train --set rollout.engine=vllm` end to end against a real vLLM: the demo environment trains,
a SIGKILL in the middle and `--resume` give one consistent run, and every update's samples come from the
trainer's current weights (the sampler/trainer logprob gap stays at float32 rounding). With
`rollout.max_staleness=1` vLLM samples on the sampler thread while the trainer steps: the same kill and
resume train every update once, and every token is within one version of its update's, read token by token
from the tree files (`tests/train/test_async_training.py` has the checks and their negative control)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.staleness_checks import queued_lags, within
from support.train_cases import kill_after_first_checkpoint, train_process

from treetrain.train.metrics import read_metrics

SETTINGS = [
    "rollout.engine=vllm", "model.path=demo-wide", "updates=3", "checkpoint_every=1", "threads=1",
    "rollout.groups_per_update=2", "rollout.fanout.root=4", "measure_memory_every=0",
]  # fmt: skip
GAP = 1e-4
"""Largest |logp_trainer - logp_vllm| on a policy token when both hold the same float32 weights."""


def _train(run: Path, staleness: int, *extra: str) -> subprocess.Popen[str]:
    return train_process(run, [*SETTINGS, f"rollout.max_staleness={staleness}"], *extra)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("staleness", [0, 1])
def test_vllm_training_survives_a_kill_and_resumes(tmp_path: Path, staleness: int) -> None:
    run = tmp_path / "run"
    proc = _train(run, staleness)
    kill_after_first_checkpoint(proc, run, 600)
    done_before = len(read_metrics(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else 0
    assert done_before < 3

    resumed = _train(run, staleness, "--resume")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m.update for m in metrics] == [0, 1, 2]
    assert len(list((run / "rollouts").iterdir())) == 3
    if staleness:
        assert metrics[-1].version >= 2  # a step can be skipped when every group had equal rewards
        lags = queued_lags(run, metrics)
        assert within(lags, 1), lags
        assert all(m.stale_tokens_dropped == 0 for m in metrics)
        fresh = [row for m in metrics for row in m.sampler_gap_by_lag if row[0] == 0]
        assert fresh and all(largest < GAP for _, _, largest, _ in fresh)  # lag 0: vLLM held the same weights
        assert any(lag == 1 for m in metrics for lag, *_ in m.sampler_gap_by_lag)
        return
    assert [m.version for m in metrics] == [1, 2, 3]
    for m in metrics:  # each update sampled with the weights it trained: synced after every step and resume
        assert m.sampler_logprob_gap_max is not None and m.sampler_logprob_gap_max < GAP, m
