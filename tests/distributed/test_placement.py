"""Placement: every trajectory on exactly one rank, balanced, with less duplicated ancestor work than round-robin."""

from __future__ import annotations

import random

import pytest
import torch
from support.replay_cases import SHAPES, factory, make_batch

from treetrain.distributed.placement import build_placement, place, round_robin
from treetrain.loss.loss_config import LossConfig
from treetrain.replay import FlatReference, ReplayConfig, TreeReplay, UpdateBatch
from treetrain.replay.verify import deviation, flat_grad, noise_floor
from treetrain.tree.synthetic import synthetic_group


def _random_trees(rng: random.Random) -> list:
    return [
        synthetic_group(
            prefix=rng.randint(1, 40),
            branches=rng.randint(1, 8),
            suffix=rng.randint(3, 30),
            depth=rng.randint(1, 3),
            vocab=50,
            seed=rng.randint(0, 10**6),
        )
        for _ in range(rng.randint(1, 4))
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_trajectory_owned_exactly_once_and_deterministic(shape: str, world_size: int) -> None:
    trees = SHAPES[shape](0)
    p = place(trees, world_size)
    for tree, per_rank in zip(trees, p.owned):
        owned = sorted(t for s in per_rank for t in s)
        assert owned == list(range(len(tree.records)))
    assert place(trees, world_size) == p and place(SHAPES[shape](0), world_size).digest == p.digest
    if world_size == 1:
        assert p.duplicated_tokens == 0 and p.rank_tokens == (p.unique_tokens,)


def test_better_than_round_robin_on_random_geometries() -> None:
    rng = random.Random(0)
    strictly = 0
    for _ in range(60):
        trees = _random_trees(rng)
        for ws in (2, 3, 4):
            p, naive = place(trees, ws), round_robin(trees, ws)
            assert p.duplicated_tokens <= naive.duplicated_tokens
            assert p.makespan <= naive.makespan
            strictly += p.duplicated_tokens < naive.duplicated_tokens
    assert strictly > 100, "placement should usually duplicate strictly less ancestor work"


def test_keeps_subtrees_together() -> None:
    """Trajectories sharing a tool result stay on one rank; whole trees go to different ranks."""
    (tree,) = SHAPES["multi_level"](0)
    p = place([tree], 2)
    naive = round_robin([tree], 2)
    assert p.duplicated_tokens < naive.duplicated_tokens
    assert {frozenset({0, 1, 2, 3}), frozenset({4, 5})} == set(p.owned[0])
    two = place(SHAPES["two_trees"](0), 2)
    assert two.duplicated_tokens == 0 and all(min(len(s) for s in per_rank) == 0 for per_rank in two.owned)


def test_build_placement_refuses_doubled_or_missing_trajectories() -> None:
    trees = SHAPES["one_level"](0)
    with pytest.raises(ValueError, match=r"doubled \[1\], missing \[3\]"):
        build_placement(trees, [[{0, 1}, {1, 2}]], 2)
    with pytest.raises(ValueError, match="2 rank entries for world size 3"):
        build_placement(trees, [[{0, 1}, {2, 3}]], 3)


def test_restricted_to_keeps_the_assignment() -> None:
    trees = SHAPES["two_trees"](0)
    p = round_robin(trees, 2)
    sub = p.restricted_to(trees[1:])
    assert sub.owned == p.owned[1:] and sub.tree_ids == p.tree_ids[1:]
    with pytest.raises(ValueError, match="no entry"):
        place(trees[:1], 2).restricted_to(trees)


LOSS = LossConfig(entropy_coef=0.01)
make_model = factory("qwen2", torch.float64)


@pytest.fixture(scope="module")
def floor() -> float:
    return noise_floor(make_model, make_batch(SHAPES["two_trees"](0), LOSS), LOSS)


@pytest.mark.parametrize(
    ("placement", "contract"),
    [("planner", "exact"), ("round_robin", "exact"), ("round_robin", "response_only")],
)
def test_rank_shares_sum_to_the_whole_gradient(placement: str, contract: str, floor: float) -> None:
    """By linearity, per-rank replays (each recomputing its ancestors, KV never shared) sum to one run."""
    trees = SHAPES["two_trees"](0)
    batch = make_batch(trees, LOSS)
    p = place(trees, 3) if placement == "planner" else round_robin(trees, 3)
    cfg = ReplayConfig(contract=contract)  # type: ignore[arg-type]
    whole_model = make_model()
    if contract == "exact":
        FlatReference(whole_model, LOSS).accumulate(batch)
    else:
        TreeReplay(whole_model, LOSS, cfg).accumulate(batch)
    whole = flat_grad(whole_model)
    split_model = make_model()
    advantages = [w.advantages for w in batch.work]
    for rank in range(3):
        share = UpdateBatch.build(trees, advantages, LOSS, owned=p.for_rank(rank))
        assert share.manifest == batch.manifest
        assert sum(len(w.trajectories) for w in share.work) == sum(len(s[rank]) for s in p.owned)
        TreeReplay(split_model, LOSS, cfg).accumulate(share)
    assert deviation(flat_grad(split_model), whole).abs <= 5 * floor
