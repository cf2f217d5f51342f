"""The longdoc environment: a document of N tokens (counted with the shipped tokenizer), one asked fact
among decoys, a `read` tool that quotes a span, and both rubrics, each with a failing case."""

from __future__ import annotations

import pytest
from support.env_fixtures import END, encode, tokenizer

from envs import EpisodeLimits, TokenEnv, WrapperConfig, format_tool_call, make_env
from envs.longdoc import LongDocEnv, LongDocTask, make_document
from treetrain.assets import tokenizer_path


def _start(seed: int = 4, num_tokens: int = 2048) -> tuple[TokenEnv, LongDocTask]:
    env = TokenEnv(
        LongDocEnv(num_tokens=num_tokens),
        tokenizer(),
        WrapperConfig(EpisodeLimits(max_episode_tokens=1 << 16)),
    )
    env.reset(seed)
    task = env.env.state()
    assert isinstance(task, LongDocTask)
    return env, task


@pytest.mark.parametrize("num_tokens", [512, 4096, 16384])
def test_the_document_is_n_tokens_of_the_given_tokenizer(num_tokens: int) -> None:
    env = LongDocEnv(num_tokens=num_tokens, tokenizer=str(tokenizer_path()))
    env.reset(1)
    task = env.state()
    assert task is not None
    tokens = len(encode(task.document.text() + "\n"))
    longest_line = max(len(encode(f"{i:04d}. {line}\n")) for i, line in enumerate(task.document.lines, 1))
    assert num_tokens - longest_line <= tokens <= num_tokens


def test_bytes_bound_the_tokens_without_a_tokenizer() -> None:
    doc = make_document(2, 4096)
    text = doc.text() + "\n"
    assert len(encode(text)) <= len(text.encode()) <= 4096
    assert len(text.encode()) > 4096 - 100


def test_seeded_and_the_fact_is_where_the_task_says() -> None:
    assert make_document(7, 3000) == make_document(7, 3000)
    assert make_document(7, 3000) != make_document(8, 3000)
    env, task = _start()
    prompt = "".join(m.content for m in env.env.reset(4))
    assert task.vault in prompt and task.code in prompt
    assert f"{task.line:04d}. The access code of the {task.vault} vault is {task.code}." in prompt
    assert len(task.document.facts) == 4 and len({f.code for f in task.document.facts}) == 4


def test_cited_answer_scores_one_on_both_rubrics() -> None:
    env, task = _start()
    env.step(encode(format_tool_call("read", {"first": task.line, "last": task.line + 1}) + END))
    assert f"{task.code}." in env.messages[-1].content
    env.step(encode(task.code + END))
    rubrics = env.env.rubrics()
    assert env.trajectory("a", rubrics["exact"]).reward == 1.0
    assert env.trajectory("b", rubrics["cited"]).reward == 1.0


def test_an_answer_without_reading_the_line_is_exact_but_not_cited() -> None:
    env, task = _start()
    other = 1 if task.line > 5 else task.line + 1
    env.step(encode(format_tool_call("read", {"first": other, "last": other}) + END))
    env.step(encode(task.code + END))
    rubrics = env.env.rubrics()
    assert env.trajectory("a", rubrics["exact"]).reward == 1.0
    assert env.trajectory("b", rubrics["cited"]).reward == 0.0


def test_a_decoy_or_a_hedge_scores_zero() -> None:
    env, task = _start()
    decoy = next(f.code for f in task.document.facts if f.code != task.code)
    env.step(encode(decoy + END))
    assert env.trajectory("d").reward == 0.0
    env, task = _start()
    env.step(encode(f"{task.code} or {decoy}" + END))
    assert env.trajectory("h").reward == 0.0


@pytest.mark.parametrize("span", [(0, 1), (3, 2), (1, 21), (1, 10**9)])
def test_a_bad_span_is_an_observation(span: tuple[int, int]) -> None:
    env, _ = _start()
    result = env.step(encode(format_tool_call("read", {"first": span[0], "last": span[1]}) + END))
    assert "ValueError" in result.messages[0].content and not result.done


@pytest.mark.parametrize("bad", [0, 255, 1 << 22, True, "4096"])
def test_bad_lengths_are_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        make_env("longdoc", num_tokens=bad)
