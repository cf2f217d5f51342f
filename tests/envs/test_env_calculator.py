"""The calculator environment: tasks, the safe evaluator, the tool and both rubrics."""

from __future__ import annotations

import re

import pytest
from support.env_fixtures import END, encode, tokenizer

from envs import EpisodeLimits, TokenEnv, WrapperConfig, format_tool_call
from envs.calculator import CalculatorEnv, make_task
from envs.calculator.arith import evaluate


def _play(turns: list[str], seed: int = 3) -> TokenEnv:
    env = TokenEnv(
        CalculatorEnv(), tokenizer(), WrapperConfig(EpisodeLimits(max_turns=6)), env_name="calculator"
    )
    env.reset(seed)
    for text in turns:
        env.step(encode(text + END))
    return env


def test_tasks_are_seeded_and_verifiable() -> None:
    tasks = [make_task(s) for s in range(20)]
    assert tasks == [make_task(s) for s in range(20)]
    assert len({t.expression for t in tasks}) > 15
    for t in tasks:
        assert evaluate(t.expression) == t.answer
        assert 2 <= len(re.findall(r"\d+", t.expression)) <= 3


@pytest.mark.parametrize("bad", ["__import__('os')", "2 ** 100", "x + 1", "1 +", "9" * 201, "True"])
def test_evaluator_rejects_non_arithmetic(bad: str) -> None:
    with pytest.raises(ValueError):
        evaluate(bad)


def test_tool_then_correct_answer_scores_one() -> None:
    task = make_task(3)
    env = _play([format_tool_call("calculate", {"expression": task.expression})], seed=3)
    obs = env.messages[-1]
    assert obs.role == "tool" and obs.content == str(task.answer)
    env.step(encode(f"The answer is {task.answer}." + END))
    rubrics = env.env.rubrics()
    assert env.trajectory("a", rubrics["exact"]).reward == 1.0
    assert env.trajectory("b", rubrics["efficient"]).reward == 1.0


def test_rubrics_score_one_episode_differently() -> None:
    task = make_task(3)
    calls = [format_tool_call("calculate", {"expression": "1 + 1"})] * 3
    env = _play([*calls, str(task.answer)])
    rubrics = env.env.rubrics()
    assert env.trajectory("a", rubrics["exact"]).reward == 1.0
    assert env.trajectory("b", rubrics["efficient"]).reward == pytest.approx(0.5)


def test_wrong_or_missing_answer_scores_zero() -> None:
    task = make_task(3)
    assert _play([str(task.answer + 1)]).trajectory("w").reward == 0.0
    assert _play(["I do not know"]).trajectory("n").reward == 0.0
    env = TokenEnv(CalculatorEnv(), tokenizer(), WrapperConfig(EpisodeLimits(max_turns=1)))
    env.reset(3)
    env.step(encode(format_tool_call("calculate", {"expression": task.expression}) + END))
    assert env.finish is not None and env.finish.value == "max_turns"
    assert env.trajectory("t").reward == 0.0


def test_bad_expression_is_an_observation() -> None:
    env = _play([format_tool_call("calculate", {"expression": "2 ** 8"})])
    assert "raised ValueError: unsupported syntax" in env.messages[-1].content
    assert not env.done
