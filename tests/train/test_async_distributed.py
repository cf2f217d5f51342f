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
SETTINGS = [
    "--set", "optim.name=sgd", "--set", "optim.lr=0.5", "--set", "rollout.groups_per_update=2",
    "--set", "threads=1", "--set", "measure_memory_every=0", "--set", f"updates={UPDATES}",
    "--set", "loss.sampler_correction=token_truncate",
]  # fmt: skip


def test_two_asynchronous_nodes_make_the_single_process_updates_from_the_same_trees(tmp_path: Path) -> None:
    nodes, single = tmp_path / "nodes", tmp_path / "single"
    two_nodes(
        nodes, *SETTINGS, "--set", "rollout.max_staleness=1",
        "--set", "distributed.backend=deepspeed", "--set", "distributed.zero_stage=2",
    )  # fmt: skip
    rows = read_metrics(nodes / "metrics.jsonl")
    assert [r.update for r in rows] == list(range(UPDATES))
    lags = {}
    for row in rows:  # every rank's queued trees, token by token, at the version the update trained at
        before = rows[row.update - 1].version if row.update else 0
        trees = [t for rank in (0, 1) for t in read_queued(nodes, row.update, rank).trees]
        assert len(trees) == 2  # one task per rank
        lags[row.update] = lags_of(trees, before)
    assert within(lags, 1) and any(s.most == 1 for s in lags.values()), lags
    assert any(r.groups > r.groups_dropped for r in rows), "no group trained: the comparison would be vacuous"
    recorded = ["--set", f"rollout.trees={nodes / 'rollouts'}"]
    assert main(["train", "--run-dir", str(single), "--no-progress", *SETTINGS, *recorded]) == 0
    start = weights(DEMO)
    got = weights(nodes / "final" / "model.safetensors")
    want = weights(single / "final" / "model.safetensors")
    start = {k: v for k, v in start.items() if k in want}
    close_delta(delta(start, got), delta(start, want), f"{UPDATES} asynchronous updates")
