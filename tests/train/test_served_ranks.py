"""Two trainer ranks fed by a real `vllm serve` (the docs' command, the session's server): `torchrun`, gloo,
DeepSpeed ZeRO-3, `rollout.engine=vllm-server`, two synchronous updates. Each rank samples its own share
of the tasks from the server; rank 0 writes the weights once per sync, one bucket at a time from the
gathered modules, and loads them; rank 1 follows (`treetrain.rollout.engines.server_ranks`). Every
update's samples come from the trainer's current weights: the sampler/trainer gap is float32 rounding
(`tests/rollout/test_served_engine.py` holds the negative control, a skipped reload, whose gap is large)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from support.ports import train_ranks

from treetrain.train.metrics import read_metrics

ASSETS = Path(__file__).resolve().parents[2] / "treetrain" / "assets"

SETTINGS = [
    "rollout.engine=vllm-server", "model.path=demo-wide", "updates=2", "checkpoint_every=0", "threads=1",
    "rollout.groups_per_update=2", "rollout.fanout.root=4", "measure_memory_every=0",
    "distributed.backend=deepspeed", "distributed.zero_stage=3",
]  # fmt: skip
GAP = 1e-4
"""Largest |logp_trainer - logp_vllm| on a policy token when both hold the same float32 weights."""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_two_zero3_ranks_sample_from_one_server_and_train(vllm_server: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    settings = [*SETTINGS, f"rollout.vllm.urls=[{json.dumps(vllm_server)}]"]
    done = train_ranks(run, settings, timeout=800)
    assert done.returncode == 0, done.output[-4000:]

    metrics = read_metrics(run / "metrics.jsonl")
    assert [m.update for m in metrics] == [0, 1] and [m.version for m in metrics] == [1, 2]
    for m in metrics:  # each update sampled with the weights it trained, on both ranks' tasks
        assert (
            m.trajectories == 8 and m.sampler_logprob_gap_max is not None and m.sampler_logprob_gap_max < GAP
        ), m
    one_copy = (ASSETS / "demo_model_wide" / "model.safetensors").stat().st_size
    for m in metrics:  # written once per sync, by rank 0 (two writers would be twice a copy)
        assert one_copy * 0.9 <= m.weight_sync_bytes < one_copy * 1.5, (m.weight_sync_bytes, one_copy)
    assert [url for url, *_ in metrics[0].servers] == [vllm_server]  # both ranks' requests, summed per server
    for update in (0, 1):  # rank 0 sampled task 0 and rank 1 task 1, each through the server
        assert len(list((run / "rollouts" / f"update-{update:05d}").rglob("*.msgpack"))) == 2
    with urllib.request.urlopen(vllm_server + "/weight_info", timeout=30) as resp:
        label = json.loads(resp.read())["weight_version"]
    assert label == f"{(run / 'engine-weights').resolve()}@1"  # rank 0's last sync, before update 1
    assert not (run / "engine-weights").exists()  # rank 0 removes what it wrote; rank 1 removes nothing
