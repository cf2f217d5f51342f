"""Planning is bounded by the file: the work `treetrain plan` does on a tree (targets, flat pricing, the
ledger) is a measured constant times the file size, counted deterministically as lines of treetrain code
executed, on constructed worst cases where the calls' total length T is far larger than the file. The
tree-side shortcuts it takes (call sizes and sampler logprobs read off the nodes) equal the per-call views
they replace."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from support.replay_cases import VOCAB
from support.tree_strategies import trajectory_sets
from support.tree_worst import _doc, _traj, comb_chain, shared_calls, wide

import treetrain
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.planner import plan_update
from treetrain.models.presets import tiny_model
from treetrain.replay import ReplayConfig, UpdateBatch
from treetrain.replay.flat_reference import FlatReference
from treetrain.trajectory import Trajectory
from treetrain.tree.build import build_tree
from treetrain.tree.format import trees_from_bytes
from treetrain.tree.trajectory_tree import ROOT, CallRef, TrajectoryTree

PACKAGE = str(Path(treetrain.__file__).parent)

#: Lines of treetrain code that planning may execute per unit of file, where the units are the file's bytes
#: plus its (node, trajectory) pairs (the one tree statistic that can outgrow the file, limited per byte by
#: `Limits.node_visits_per_byte`), plus a fixed part (the search, the ledger, the cached calibration).
#: Measured (`pytest -s` prints them): 0.8 to 2.7 lines per unit, 7.1 on the chain. Planning that walked
#: each call's own tokens would run calls^3 x prefix lines on `shared_calls`.
LINES_PER_UNIT = 12
FIXED_LINES = 200_000

_MODEL = tiny_model("llama", 8)  # `calls` and `call_sizes` read only its device


@contextmanager
def line_count() -> Iterator[list[int]]:
    """Counts the lines of treetrain code executed inside the block (deterministic, unlike time)."""
    count = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "line":
            count[0] += 1
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        return local if frame.f_code.co_filename.startswith(PACKAGE) else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield count
    finally:
        sys.settrace(previous)


def _batch(trees: list[TrajectoryTree], loss: LossConfig) -> UpdateBatch:
    adv = compute_advantages(trees, AdvantageConfig())
    return UpdateBatch.build(trees, adv.trees, loss)


def chain_calls(depth: int, calls: int) -> bytes:
    """One trajectory whose `calls` calls all end at the bottom of a chain of `depth` prompt nodes (each
    with a one-token policy leaf, so every node is a divergence point): T = calls x depth."""
    nodes, trajs, parent = comb_chain(depth)
    call = {"end": parent + 1, "segment_lengths": [depth, 1], "logprobs": [None]}
    chain_end = {
        "end": parent,
        "segment_lengths": [depth],
        "logprobs": [],
    }  # a node with one child ends a call
    trajs.append(_traj("deep", [chain_end] + [call] * calls))
    return _doc(nodes, trajs)


CASES: dict[str, Callable[[], bytes]] = {
    "50 calls through a 2,000-token prefix": lambda: shared_calls(2_000, 50, logprobs=True),
    "2,684 calls through a 100,000-token prefix (T = 2.7e8)": lambda: shared_calls(
        100_000, 2_684, logprobs=True
    ),
    "300 calls to the bottom of a 300-node chain": lambda: chain_calls(300, 300),
    "1,000 trajectories on one wide node": lambda: wide(1_000),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", VOCAB)  # the planner tests' model: its calibration is cached in-process


@pytest.mark.parametrize("name", list(CASES))
def test_planning_work_is_a_constant_times_the_file(model, name: str) -> None:
    blob = CASES[name]()
    trees = list(trees_from_bytes(blob))
    loss = LossConfig()
    plan_update(_batch(trees, loss), model, budget=1 << 30)  # calibrates outside the count
    with line_count() as lines:
        plan_update(_batch(trees, loss), model, budget=1 << 30)
    units = len(blob) + sum(len(n.trajectories) for t in trees for n in t.nodes)
    print(f"{name}: {len(blob)} bytes, {units} units, {lines[0]} lines, {lines[0] / units:.2f} per unit")
    assert lines[0] <= LINES_PER_UNIT * units + FIXED_LINES


def test_the_count_sees_per_token_work() -> None:
    """Negative control: the flat oracle rebuilds every call token by token, and the count shows it."""
    blob = shared_calls(200, 40)
    trees = list(trees_from_bytes(blob))
    batch = _batch(trees, LossConfig())
    flat = FlatReference(_MODEL, LossConfig())
    with line_count() as lines:
        flat.calls(batch)
    assert lines[0] > LINES_PER_UNIT * 2 * len(blob) + FIXED_LINES  # one trajectory: 1 pair per node
    with line_count() as sizes:
        flat.call_sizes(batch)
    assert sizes[0] < lines[0] / 100


@settings(max_examples=40, deadline=None)
@given(trajectory_sets(max_calls=4))
def test_call_sizes_equal_the_calls(trajs: list[Trajectory]) -> None:
    tree = build_tree(trajs)
    for loss in (LossConfig(), LossConfig(aggregation="seq-mean-token-mean")):
        batch = _batch([tree], loss)
        for order in ("tree", "reverse", "shuffle"):
            flat = FlatReference(_MODEL, loss, ReplayConfig(microbatch=1, order=order, seed=3))
            expected = [(len(c.tokens), c.targets.num_targets) for c in flat.calls(batch)]
            assert [(s.tokens, s.targets) for s in flat.call_sizes(batch)] == expected


@settings(max_examples=40, deadline=None)
@given(trajectory_sets(max_calls=4))
def test_tree_targets_take_the_owning_calls_sampler_logprobs(trajs: list[Trajectory]) -> None:
    """Each contribution's sampler logprob is the one the earliest call through its node gave that token."""
    tree = build_tree(trajs)
    batch = _batch([tree], LossConfig())
    if not batch.work:
        return
    tables = batch.work[0].targets
    for node in tree.nodes:
        if node.index == ROOT:
            continue
        table = tables[node.index]
        for c, target in enumerate(table.contrib_target):
            j = int(table.trajectory[c])
            owner = next(
                ci for ci, rec in enumerate(tree.records[j].calls) if node.index in tree.path(rec.end)
            )
            lps = tree.sampler_logprobs(CallRef(j, owner))
            expected = math.nan if lps is None else lps[node.offset + int(table.positions[target])]
            got = float(table.sampler_logprob[c])
            assert (math.isnan(expected) and math.isnan(got)) or got == expected
