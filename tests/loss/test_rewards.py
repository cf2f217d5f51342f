"""Rewards come from user code and files: finite and within REWARD_LIMIT, or refused where they enter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from envs.protocol import Episode, ProtocolError, Rubric
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.trajectory import REWARD_LIMIT, Call, Role, Segment, Trajectory, TrajectoryError
from treetrain.tree.build import build_tree

CALL = Call((Segment(Role.PROMPT, (1, 2, 3)), Segment(Role.POLICY, (4, 5), (-0.1, -0.2))))


@pytest.mark.parametrize("reward", [1e308, -1e16, 10**400, float("nan"), "1", True])
def test_a_reward_beyond_the_limit_or_not_a_number_is_refused(reward: object) -> None:
    with pytest.raises(TrajectoryError, match="reward"):
        Trajectory("t", (CALL,), reward=reward)  # type: ignore[arg-type]
    with pytest.raises(TrajectoryError, match=r"step_rewards\[0\]"):
        Trajectory("t", (CALL,), reward=0.0, step_rewards=(reward,))  # type: ignore[arg-type]


@pytest.mark.parametrize("normalize_std", [True, False])
def test_advantages_at_the_limit_are_finite(normalize_std: bool) -> None:
    trajectories = [
        Trajectory(f"t{i}", (CALL,), reward=r) for i, r in enumerate([REWARD_LIMIT, -REWARD_LIMIT, 0.0])
    ]
    group = compute_advantages([build_tree(trajectories)], AdvantageConfig(normalize_std=normalize_std))
    values = group.trees[0].values
    assert values.shape[0] == 3 and bool((abs(values) < float("inf")).all())


class _Fixed(Rubric):
    def __init__(self, value: object) -> None:
        self.value = value

    def score(self, episode: Episode) -> float:
        return self.value  # type: ignore[return-value]


@pytest.mark.parametrize("value", [1e300, 10**400, "1", float("inf")])
def test_a_rubric_reward_out_of_range_is_a_protocol_error(value: object) -> None:
    with pytest.raises(ProtocolError, match="_Fixed's reward"):
        _Fixed(value)(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.25), torch.tensor(0.75)])
def test_a_rubric_may_return_any_real_scalar(value: object) -> None:
    assert _Fixed(value)(None) == float(value)  # type: ignore[arg-type]
