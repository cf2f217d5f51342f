"""Weights updated in flight: a rollout whose engine takes new weights between its steps records, turn by
turn, the version that sampled each token, and each token's recorded logprob is that version's own.

The differential check scores every policy segment again with the model of the version it recorded (the
sampler's logprob at temperature 1 is the model's log-softmax), against the measured noise floor of
float64; the negative control scores it with the other version's model and finds the gap."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from support.env_fixtures import FixedTurnsEnv, tiny_model, tokenizer
from support.replay_cases import make_batch

from envs import EpisodeLimits, WrapperConfig
from treetrain.loss.loss_config import LossConfig
from treetrain.replay import FlatReference, ReplayConfig, TreeReplay
from treetrain.rollout import FanOut, RolloutConfig, SamplerConfig, Sampling, rollout_trees
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.rollout.engines.hf_process import HFProcessEngine
from treetrain.rollout.sources.staleness import Staleness
from treetrain.rollout.weight_feed import WeightFeed
from treetrain.trajectory import Role, Trajectory
from treetrain.tree.format import load_trees

torch.set_num_threads(1)
LIMITS = WrapperConfig(EpisodeLimits(max_turns=4, max_turn_tokens=6, max_episode_tokens=1024))
FLOOR = 2e-6
"""Tree files keep logprobs in float32: measured at most 4.8e-7 (float32 rounding of values near -4)."""


class PublishesAfter(WeightFeed):
    """A feed whose trainer publishes `newer` as version 1 once `engine` (set after the feed is made) has
    drawn `after` tokens and still has requests in flight: mid-rollout, and, with few tokens drawn, halfway
    through a turn (the requests in flight are interrupted)."""

    def __init__(self, model: Any, newer: Any, after: int, shared: bool = False) -> None:
        super().__init__(model, version=0, own_model=not shared, shared=shared)
        self.newer, self.after = newer, after
        self.engine: Any = None

    def due(self, engine_version: int) -> bool:
        if self.version == 0 and self.engine.busy and self.engine.stats.sampled_tokens >= self.after:
            self.publish(self.newer, 1)
        return super().due(engine_version)


def _gaps(trajectory: Trajectory, models: dict[int, Any], swap: bool = False) -> list[float]:
    """|recorded - rescored| logprob of every policy token, rescored by its version's model (or, with `swap`,
    by the other version's)."""
    out = []
    for call in trajectory.calls:
        tokens = [t for seg in call.segments for t in seg.tokens]
        with torch.no_grad():
            logp = torch.log_softmax(models[0 if swap else 1](torch.tensor([tokens])).logits[0].double(), -1)
            other = torch.log_softmax(models[1 if swap else 0](torch.tensor([tokens])).logits[0].double(), -1)
        pos = 0
        for seg in call.segments:
            if seg.role is Role.POLICY:
                assert seg.version in (0, 1) and seg.logprobs is not None
                table = logp if seg.version == 1 else other
                for k, (tok, lp) in enumerate(zip(seg.tokens, seg.logprobs)):
                    out.append(abs(float(table[pos + k - 1, tok]) - lp))
            pos += len(seg.tokens)
    return out


@pytest.mark.parametrize(
    "own_process", [False, pytest.param(True, marks=pytest.mark.launch, id="hf-process")]
)  # fmt: skip
def test_an_engine_takes_new_weights_between_turns_and_each_turn_records_its_version(
    tmp_path: Path, own_process: bool
) -> None:
    """The `hf` engine on this thread over the feed's own model, and in its own process over the shared
    shadow (an asynchronous run's)."""
    old = tiny_model(seed=0).eval()
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    feed = PublishesAfter(old, new, after=12, shared=own_process)  # after a first request's 2 x 6 tokens
    engine: Any = HFProcessEngine(feed.shadow, version=0) if own_process else HFEngine(feed.sampling_model)
    feed.engine = engine
    config = RolloutConfig(
        FanOut(root=2, after_tool_result=2, max_depth=2), SamplerConfig(Sampling()), LIMITS
    )
    try:
        result = rollout_trees(
            feed.sampling_model, tokenizer(), FixedTurnsEnv, [0, 1], tmp_path, config, engine=engine,
            weights=feed,
        )  # fmt: skip
    finally:
        engine.close()
    assert feed.syncs == 1 and engine.version == 1
    trajectories = [t for tree in result.trees for t in tree.trajectories()]
    versions = [
        {seg.version for c in t.calls for seg in c.segments if seg.role is Role.POLICY} for t in trajectories
    ]
    assert {0, 1} in versions  # an episode whose turns span two versions
    assert any(len(set().union(*(tree.node_versions))) == 2 for tree in result.trees)  # a tree of both
    models = {0: old, 1: new}
    gaps = [g for t in trajectories for g in _gaps(t, models)]
    assert gaps and max(gaps) < FLOOR, max(gaps)
    swapped = [g for t in trajectories for g in _gaps(t, models, swap=True)]
    assert max(swapped) > 1e-3  # negative control: the other version's model does not give these logprobs

    # The trainer at version 1 scores them: the gap split by lag is float32 rounding at lag 0 and the
    # change of weights at lag 1, and the tree replay splits it as the flat reference does.
    batch = make_batch(list(result.trees), LossConfig())
    tree_gap = (
        TreeReplay(copy.deepcopy(new), LossConfig(), ReplayConfig(skip_inert=False))
        .accumulate(batch)
        .sampler_gap
    )
    flat_gap = (
        FlatReference(copy.deepcopy(new), LossConfig(), ReplayConfig(microbatch=4))
        .accumulate(batch)
        .sampler_gap
    )
    (lag0, _, max0, n0), (lag1, mean1, _, n1) = tree_gap.by_lag(1)
    assert (lag0, lag1) == (0, 1) and max0 < FLOOR and mean1 > 1e-3 and n0 + n1 == tree_gap.tokens
    for a, b in zip(tree_gap.by_lag(1), flat_gap.by_lag(1)):
        assert a[0] == b[0] and a[3] == b[3] and a[1] == pytest.approx(b[1], rel=1e-9)


def test_the_trainers_model_is_never_the_one_sampled_from() -> None:
    policy = tiny_model(seed=1)
    feed = WeightFeed(policy, version=0, own_model=True)
    sampler = feed.sampling_model
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(policy.parameters(), sampler.parameters()))
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(feed.shadow.parameters(), sampler.parameters()))
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    feed.publish(policy, 1)
    assert not torch.equal(next(sampler.parameters()), next(policy.parameters()))  # not until a sync
    feed.sync(HFEngine(sampler))
    assert torch.equal(next(sampler.parameters()), next(policy.parameters()))


def test_a_turn_interrupted_for_new_weights_is_two_policy_segments_each_with_its_version(
    tmp_path: Path,
) -> None:
    old = tiny_model(seed=0).eval()
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    feed = PublishesAfter(old, new, after=3)
    engine = feed.engine = HFEngine(feed.sampling_model)
    config = RolloutConfig(
        FanOut(root=2, after_tool_result=2, max_depth=2), SamplerConfig(Sampling()), LIMITS
    )
    result = rollout_trees(
        feed.sampling_model, tokenizer(), FixedTurnsEnv, [0, 1], tmp_path, config, engine=engine, weights=feed
    )
    assert feed.syncs == 1
    trajectories = [t for tree in result.trees for t in tree.trajectories()]
    split = [
        (a.version, b.version)
        for t in trajectories
        for c in t.calls
        for a, b in zip(c.segments, c.segments[1:])
        if a.role is b.role is Role.POLICY
    ]
    assert split and set(split) == {(0, 1)}  # a turn begun under version 0 and finished under version 1
    assert [t for p in result.paths for tree in load_trees(p) for t in tree.trajectories()] == trajectories
    models = {0: old, 1: new}
    gaps = [g for t in trajectories for g in _gaps(t, models)]
    assert max(gaps) < FLOOR, max(gaps)
    swapped = [g for t in trajectories for g in _gaps(t, models, swap=True)]
    assert max(swapped) > 1e-3  # negative control
    lags = [Staleness.of(tree, version=1) for tree in result.trees]
    assert {lag for s in lags for lag, _ in s.histogram} == {0, 1}


def test_an_interrupted_greedy_sample_goes_on_exactly_as_if_it_had_not_been(tmp_path: Path) -> None:
    """Differential: with the same weights published as a new version mid-turn, the resubmitted samples
    (context plus the tokens so far) finish exactly as the uninterrupted rollout's, token for token; only
    the recorded versions tell them apart."""
    policy = tiny_model(seed=3).eval()
    config = RolloutConfig(
        FanOut(root=2, after_tool_result=2, max_depth=2), SamplerConfig(Sampling(temperature=0.0)), LIMITS
    )

    def grow(out: Path, publish: bool) -> list[Trajectory]:
        feed = PublishesAfter(policy, policy, after=3 if publish else 10**9)
        engine = feed.engine = HFEngine(feed.sampling_model)
        result = rollout_trees(
            feed.sampling_model, tokenizer(), FixedTurnsEnv, [0, 1], out, config, engine=engine, weights=feed
        )
        assert feed.syncs == int(publish)
        return [t for tree in result.trees for t in tree.trajectories()]

    whole, cut = grow(tmp_path / "whole", publish=False), grow(tmp_path / "cut", publish=True)
    assert [c.tokens for t in whole for c in t.calls] == [c.tokens for t in cut for c in t.calls]
    assert [c.roles for t in whole for c in t.calls] == [c.roles for t in cut for c in t.calls]
    versions = {s.version for t in cut for c in t.calls for s in c.segments if s.role is Role.POLICY}
    assert versions == {0, 1} and len([s for t in cut for c in t.calls for s in c.segments]) > len(
        [s for t in whole for c in t.calls for s in c.segments]
    )  # some turns were split between the two versions
