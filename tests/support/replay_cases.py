"""Shared cases for the engine's differential tests: tree shapes, tiny models and update batches."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.models.presets import tiny_model
from treetrain.replay import UpdateBatch
from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree import TrajectoryTree
from treetrain.tree.build import build_tree
from treetrain.tree.synthetic import synthetic_group

VOCAB = 64


def _seg(rng: random.Random, role: Role, n: int) -> Segment:
    toks = tuple(rng.randrange(1, VOCAB) for _ in range(n))
    lps = tuple(-rng.random() * 2 for _ in range(n)) if role is Role.POLICY else None
    return Segment(role, toks, lps)


def _traj(i: int, segs: list[Segment], reward: float) -> Trajectory:
    return Trajectory(f"t{i}", (Call(tuple(segs)),), reward)


def shape_one_level(seed: int = 0) -> list[TrajectoryTree]:
    return [synthetic_group(prefix=24, branches=4, suffix=6, depth=1, vocab=VOCAB, seed=seed)]


def shape_multi_level(seed: int = 0) -> list[TrajectoryTree]:
    """Several levels, policy tokens inside shared internal nodes, divergence at a tool result."""
    rng = random.Random(seed)
    prompt = _seg(rng, Role.PROMPT, 16)
    turn_a = _seg(rng, Role.POLICY, 5)
    obs_1, obs_2 = _seg(rng, Role.OBSERVATION, 4), _seg(rng, Role.OBSERVATION, 3)
    trajs = []
    for g in range(6):
        segs = [prompt]
        if g < 4:
            segs += [turn_a, obs_1 if g < 2 else obs_2]  # same turn, different tool results
        else:
            segs += [_seg(rng, Role.POLICY, 3), _seg(rng, Role.OBSERVATION, 2)]
        segs.append(_seg(rng, Role.POLICY, rng.randrange(2, 7)))
        trajs.append(_traj(g, segs, float(rng.random())))
    return [build_tree(trajs)]


def shape_single(seed: int = 0) -> list[TrajectoryTree]:
    rng = random.Random(seed)
    segs = [_seg(rng, Role.PROMPT, 10), _seg(rng, Role.POLICY, 5), _seg(rng, Role.OBSERVATION, 3)]
    segs.append(_seg(rng, Role.POLICY, 4))
    return [build_tree([_traj(0, segs, 1.0)])]


def shape_identical(seed: int = 0) -> list[TrajectoryTree]:
    rng = random.Random(seed)
    segs = [_seg(rng, Role.PROMPT, 12), _seg(rng, Role.POLICY, 6)]
    trajs = [_traj(i, segs, float(i % 2)) for i in range(3)]
    return [build_tree(trajs)]


def shape_unequal(seed: int = 0) -> list[TrajectoryTree]:
    rng = random.Random(seed)
    prompt = _seg(rng, Role.PROMPT, 14)
    trajs = [
        _traj(i, [prompt, _seg(rng, Role.POLICY, n)], float(rng.random())) for i, n in enumerate((1, 2, 9, 4))
    ]
    return [build_tree(trajs)]


def shape_multi_call(seed: int = 0) -> list[TrajectoryTree]:
    """Three levels and two calls per trajectory: the second call drops the first call's reasoning, so it
    is its own path under the shared prompt, with policy tokens owned by the first call (no loss) and the
    tool result diverging under a shared tool call."""
    rng = random.Random(seed)
    prompt = _seg(rng, Role.PROMPT, 12)
    thoughts = [_seg(rng, Role.POLICY, 3) for _ in range(2)]
    tool_call = _seg(rng, Role.POLICY, 4)
    results = [_seg(rng, Role.OBSERVATION, 3) for _ in range(2)]
    trajs = []
    for g in range(5):
        first = Call((prompt, thoughts[g % 2], tool_call))
        answer = _seg(rng, Role.POLICY, rng.randrange(2, 6))
        second = Call((prompt, tool_call, results[g // 3], answer))
        trajs.append(Trajectory(f"t{g}", (first, second), float(rng.random())))
    return [build_tree(trajs)]


def shape_two_trees(seed: int = 0) -> list[TrajectoryTree]:
    """A group of two trees normalized together."""
    return shape_multi_level(seed) + shape_one_level(seed + 1)


SHAPES: dict[str, Callable[[int], list[TrajectoryTree]]] = {
    "one_level": shape_one_level,
    "multi_level": shape_multi_level,
    "single": shape_single,
    "identical": shape_identical,
    "unequal": shape_unequal,
    "two_trees": shape_two_trees,
    "multi_call": shape_multi_call,
}


def make_batch(
    trees: list[TrajectoryTree], loss: LossConfig, adv: AdvantageConfig | None = None
) -> UpdateBatch:
    group = compute_advantages(trees, adv or AdvantageConfig(zero_variance="keep"))
    return UpdateBatch.build(trees, group.trees, loss)


def factory(
    family: str, dtype: torch.dtype, attn: str = "sdpa", seed: int = 1
) -> Callable[[], PreTrainedModel]:
    return lambda: tiny_model(family, VOCAB, dtype=dtype, attn=attn, seed=seed)
