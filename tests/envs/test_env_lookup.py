"""The lookup environment: a long table in the prompt, a lookup tool, and both rubrics."""

from __future__ import annotations

from support.env_fixtures import END, encode, tokenizer

from envs import EpisodeLimits, TokenEnv, WrapperConfig, format_tool_call
from envs.lookup import LookupEnv, LookupTask, make_table
from envs.lookup.table import CITIES


def _start(seed: int = 5, rows: int = 30) -> tuple[TokenEnv, LookupTask]:
    env = TokenEnv(
        LookupEnv(num_rows=rows, num_warehouses=6),
        tokenizer(),
        WrapperConfig(EpisodeLimits(max_episode_tokens=1 << 16)),
    )
    env.reset(seed)
    task = env.env.state()
    assert isinstance(task, LookupTask)
    return env, task


def test_table_is_seeded_and_the_answer_needs_the_tool() -> None:
    assert make_table(1, 50, 8) == make_table(1, 50, 8)
    env, task = _start()
    prompt = "".join(m.content for m in env.messages)
    assert task.item_name in prompt and task.code in prompt
    assert task.answer in CITIES
    rows = [r for r in task.table.rows if r.name == task.item_name]
    assert len(rows) == 1 and rows[0].warehouse == task.code


def test_prompt_grows_with_the_document() -> None:
    short = TokenEnv(LookupEnv(num_rows=10), tokenizer()).reset(0)
    long = TokenEnv(LookupEnv(num_rows=200), tokenizer()).reset(0)
    assert len(long) > 10 * len(short) / 2 and len(long) > 4000


def test_grounded_answer_scores_one() -> None:
    env, task = _start()
    env.step(encode(format_tool_call("lookup", {"code": task.code}) + END))
    assert env.messages[-1].content == f"{task.code}: {task.answer}"
    env.step(encode(task.answer + END))
    rubrics = env.env.rubrics()
    assert env.trajectory("a", rubrics["exact"]).reward == 1.0
    assert env.trajectory("b", rubrics["grounded"]).reward == 1.0


def test_guess_without_lookup_is_exact_but_not_grounded() -> None:
    env, task = _start()
    env.step(encode(task.answer + END))
    rubrics = env.env.rubrics()
    assert env.trajectory("a", rubrics["exact"]).reward == 1.0
    assert env.trajectory("b", rubrics["grounded"]).reward == 0.0


def test_wrong_or_hedged_city_scores_zero() -> None:
    env, task = _start()
    other = next(c for c in CITIES if c != task.answer)
    env.step(encode(other + END))
    assert env.trajectory("w").reward == 0.0
    env, task = _start()
    env.step(encode(f"{task.answer} or {other}" + END))
    assert env.trajectory("h").reward == 0.0


def test_unknown_code_is_an_observation() -> None:
    env, _ = _start()
    result = env.step(encode(format_tool_call("lookup", {"code": "W1"}) + END))
    assert "raised KeyError" in result.messages[0].content and "W1" in result.messages[0].content
    assert not result.done
