"""Asynchronous training across ranks: `treetrain train` as 2 nodes x 1 process under DeepSpeed ZeRO-2 with
`rollout.max_staleness=1` makes, from the same trees, the updates a single process makes.

Each rank's sampler thread grows its own tasks while its training thread steps; the trees meet on the
training threads (the only place collectives run). The single-process counterpart trains the trees the
2-node run queued (`rollout.trees` over its `rollouts/`, with the same decoupled-PPO correction), so both
take the same tokens with the same sampler logprobs. SGD makes each delta -lr * g; the runs differ only in
the order of fp32 reductions, and the negative control is a delta of the wrong scale
(`support.two_nodes.close_delta`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.staleness_checks import within
from support.two_nodes import DEMO, close_delta, delta, two_nodes, weights

from treetrain.cli.main import main
from treetrain.rollout.sources.produced import lags_of
from treetrain.rollout.sources.tree_queue import read_queued
from treetrain.train.metrics import read_metrics

pytestmark = pytest.mark.distributed
UPDATES = 3
GAP = 1e-4
"""Largest lag-0 sampler/trainer logprob gap: float32 rounding between the sampler's decode steps and the
trainer's forward (a sampler on other weights is far outside)."""
SETTINGS = [
    "--set", "optim.name=sgd", "--set", "optim.lr=0.5", "--set", "rollout.groups_per_update=2",
    "--set", "threads=1", "--set", "measure_memory_every=0", "--set", f"updates={UPDATES}",
    "--set", "loss.sampler_correction=token_truncate",
]  # fmt: skip


@pytest.mark.parametrize("stage", [2, 3])
def test_two_asynchronous_nodes_make_the_single_process_updates_from_the_same_trees(
    tmp_path: Path, stage: int
) -> None:
    """ZeRO-2: each rank's sampler grows its own task. ZeRO-3: rank 0's `hf` process grows both, from the one
    shadow that both ranks' gathers fill (`treetrain.rollout.gathered_feed`), and rank 1 samples nothing.
    The lag-0 gap at rounding shows that the sampler held the weights it recorded."""
    nodes, single = tmp_path / "nodes", tmp_path / "single"
    two_nodes(
        nodes, *SETTINGS, "--set", "rollout.max_staleness=1",
        "--set", "distributed.backend=deepspeed", "--set", f"distributed.zero_stage={stage}",
    )  # fmt: skip
    rows = read_metrics(nodes / "metrics.jsonl")
    assert [r.update for r in rows] == list(range(UPDATES))
    lags = {}
    for row in rows:  # every rank's queued trees, token by token, at the version the update trained at
        before = rows[row.update - 1].version if row.update else 0
        samplers = (0, 1) if stage == 2 else (0,)
        trees = [t for rank in samplers for t in read_queued(nodes, row.update, rank).trees]
        assert len(trees) == 2  # one task per rank, or both on rank 0
        if stage == 3:
            with pytest.raises(OSError):  # rank 1 queued nothing: it has no sampler
                read_queued(nodes, row.update, 1)
        lags[row.update] = lags_of(trees, before)
    assert within(lags, 1) and any(s.most == 1 for s in lags.values()), lags
    fresh = [
        row for r in rows for row in r.sampler_gap_by_lag if row[0] == 0
    ]  # sampled by the newest weights
    assert fresh and all(largest < GAP for _, _, largest, _ in fresh), fresh  # the sampler held them
    assert any(r.groups > r.groups_dropped for r in rows), "no group trained: the comparison would be vacuous"
    recorded = ["--set", f"rollout.trees={nodes / 'rollouts'}"]
    assert main(["train", "--run-dir", str(single), "--no-progress", *SETTINGS, *recorded]) == 0
    start = weights(DEMO)
    got = weights(nodes / "final" / "model.safetensors")
    want = weights(single / "final" / "model.safetensors")
    start = {k: v for k, v in start.items() if k in want}
    close_delta(delta(start, got), delta(start, want), f"{UPDATES} asynchronous updates")
