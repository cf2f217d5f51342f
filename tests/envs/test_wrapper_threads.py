"""`TokenEnv` episodes stepped and forked from many threads at once, as the concurrent rollout scheduler
does: each episode is its own object (the tokenizer and chat template are only read), so the trajectories
equal those of a sequential run, for in-process environments and for ones in worker processes."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.env_fixtures import END, encode, tokenizer

from envs import EpisodeLimits, TokenEnv, WrapperConfig, format_tool_call
from envs.calculator import CalculatorEnv
from envs.calculator.env import make_task
from envs.protocol import Environment
from envs.remote import WorkerEnvFactory
from treetrain.trajectory import Trajectory

CONFIG = WrapperConfig(EpisodeLimits(max_turns=4, max_episode_tokens=1024))
SEEDS = list(range(16))


def _episode(make: Callable[[], Environment], seed: int) -> tuple[Trajectory, Trajectory]:
    """A tool call then the right answer; its fork (made before either) answers 0 at once."""
    env = TokenEnv(make(), tokenizer(), CONFIG, env_name="calculator")
    env.reset(seed)
    twin = env.fork(1)
    task = make_task(seed, 2, 2)
    assert not env.step(encode(format_tool_call("calculate", {"expression": task.expression}) + END)).done
    assert env.step(encode(f"{task.answer}{END}")).done
    assert twin.step(encode(f"0{END}")).done
    return env.trajectory(f"s{seed}"), twin.trajectory(f"s{seed}-fork")


@pytest.mark.parametrize("where", ["in-process", "worker"])
def test_episodes_in_threads_equal_a_sequential_run(where: str) -> None:
    factory = WorkerEnvFactory("calculator", {"max_operands": 2}, timeout=30.0, max_concurrent=8)
    make: Callable[[], Environment] = factory if where == "worker" else lambda: CalculatorEnv(max_operands=2)
    try:
        expected = [_episode(make, seed) for seed in SEEDS]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda seed: _episode(make, seed), SEEDS))
    finally:
        factory.close()
    assert got == expected
    # Controls: the episodes differ from each other, and the comparison would see a swapped pair.
    assert len({t.calls for t, _ in expected}) == len(SEEDS)
    assert [t.reward for t, _ in expected] == [1.0] * len(SEEDS)
    assert got[::-1] != expected


def _branches(root: TokenEnv, pool: ThreadPoolExecutor | None) -> list[Trajectory]:
    """Six forks of one episode (they share its chat template), each stepped with its own answer."""
    task = make_task(0, 2, 2)

    def branch(k: int) -> Trajectory:
        twin = root.fork(k)
        if k % 2:
            twin.step(encode(format_tool_call("calculate", {"expression": task.expression}) + END))
        assert twin.step(encode(f"{task.answer + k // 2}{END}")).done
        return twin.trajectory(f"b{k}")

    return list(pool.map(branch, range(6)) if pool else map(branch, range(6)))


@pytest.mark.parametrize("where", ["in-process", "worker"])
def test_forks_of_one_episode_stepped_in_threads_equal_a_sequential_run(where: str) -> None:
    factory = WorkerEnvFactory("calculator", {"max_operands": 2}, timeout=30.0, max_concurrent=8)
    make: Callable[[], Environment] = factory if where == "worker" else lambda: CalculatorEnv(max_operands=2)
    try:
        root = TokenEnv(make(), tokenizer(), CONFIG, env_name="calculator")
        root.reset(0)
        expected = _branches(root, None)
        with ThreadPoolExecutor(6) as pool:
            got = _branches(root, pool)
    finally:
        factory.close()
    assert got == expected
    assert [t.reward for t in expected] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # control: the branches differ
    assert len({t.calls for t in expected}) == 6
