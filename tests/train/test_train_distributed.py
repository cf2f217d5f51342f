"""`treetrain train` as 2 nodes x 1 process under DeepSpeed ZeRO-3 makes the single-process updates.

Two `torchrun --nnodes=2 --nproc_per_node=1` launchers (one per "node") meet through c10d rendezvous on
127.0.0.1 at a free port and share one run directory, as two machines would on a shared filesystem. The
whole trainer runs: rollouts split over the nodes and exchanged (each rank generating different lengths,
with the parameters partitioned), planning, the update window, the step, checkpoint, metrics, export. The
first launch makes update 1; a second pair of launchers resumes from its checkpoint and runs update 2.
Both must equal the single-process run of 2 updates (per-task seeds, so the same trees are sampled). The
optimizer is SGD, so each delta is -lr * g and its scale is checked too. The tolerance is relative to the
delta: the runs differ only in the order of fp32 reductions (measured below 1e-6); the negative control
is a delta of the wrong scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.two_nodes import DEMO, close_delta, two_nodes
from support.two_nodes import delta as _delta
from support.two_nodes import weights as _weights

from treetrain.cli.main import main
from treetrain.train.metrics import read_metrics

pytestmark = pytest.mark.distributed
SETTINGS = [
    "--set", "optim.name=sgd", "--set", "optim.lr=0.5", "--set", "rollout.groups_per_update=2",
    "--set", "threads=1", "--set", "measure_memory_every=0", "--set", "checkpoint_every=1",
]  # fmt: skip
NODES = ["--set", "distributed.backend=deepspeed", "--set", "distributed.zero_stage=3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("train_nodes")
    single, nodes = base / "single", base / "nodes"
    assert main(["train", "--run-dir", str(single), "--no-progress", "--updates", "2", *SETTINGS]) == 0
    two_nodes(nodes, *SETTINGS, *NODES, "--updates", "1")
    first = base / "nodes-update1.safetensors"
    first.write_bytes((nodes / "final" / "model.safetensors").read_bytes())
    two_nodes(nodes, *SETTINGS, *NODES, "--updates", "2", "--resume")
    return {"single": single, "nodes": nodes, "first": first}


def test_two_nodes_make_the_single_process_updates_across_a_resume(runs: dict[str, Path]) -> None:
    """Update 1 trains; in update 2 every sampled group has zero reward variance (these seeds), so no
    step is taken in either run: the resumed 2-node run must keep exactly the weights its checkpoint held."""
    single, nodes = runs["single"], runs["nodes"]
    start = _weights(DEMO)
    tied = _weights(single / "checkpoints" / "update-00001" / "model.safetensors").keys()
    start = {k: v for k, v in start.items() if k in tied}
    one = _weights(single / "checkpoints" / "update-00001" / "model.safetensors")
    two = {k: v for k, v in _weights(single / "final" / "model.safetensors").items() if k in tied}
    first = {k: v for k, v in _weights(runs["first"]).items() if k in tied}
    close_delta(_delta(start, first), _delta(start, one), "update 1")
    assert float(_delta(one, two).abs().max()) == 0.0, "the workload changed: update 2 now trains"
    assert float(_delta(first, _weights(nodes / "final" / "model.safetensors")).abs().max()) == 0.0


def test_two_nodes_share_metrics_and_checkpoints(runs: dict[str, Path]) -> None:
    single, nodes = runs["single"], runs["nodes"]
    a, b = read_metrics(single / "metrics.jsonl"), read_metrics(nodes / "metrics.jsonl")
    assert [r.update for r in b] == [0, 1], "one metrics row per update, across the resume"
    for x, y in zip(a, b):
        assert (x.reward_mean, x.trajectories, x.groups, x.groups_dropped) == (
            y.reward_mean, y.trajectories, y.groups, y.groups_dropped,
        )  # fmt: skip
        assert x.replay_imbalance == 1.0  # one process
    assert b[0].replay_tokens_max >= b[0].replay_tokens_mean > 0 and b[0].replay_imbalance >= 1.0
    assert a[0].groups - a[0].groups_dropped > 0, "no group trained: the comparison would be vacuous"
    for row in (a[0], b[0]):  # the sampler gap over both ranks' tokens (the demo samples at temperature 1)
        assert row.sampler_logprob_gap_mean is not None and row.sampler_logprob_gap_max is not None
        assert 0.0 <= row.sampler_logprob_gap_mean <= row.sampler_logprob_gap_max < 1e-2
    assert sorted(p.name for p in (nodes / "checkpoints").iterdir()) == ["update-00001", "update-00002"]
    assert (nodes / "final" / "config.json").is_file() and (nodes / "summary.txt").is_file()
    assert not [p for p in nodes.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name], "temporaries left"
