"""The token-level wrapper: segments and roles, template deltas, budgets, forking, errors."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from support.env_fixtures import END, FixedTurnsEnv, FlakyToolsEnv, encode, tokenizer

from envs import (
    EnvStepError,
    EpisodeLimits,
    Finish,
    Message,
    StepResult,
    TokenEnv,
    WrapperConfig,
    format_tool_call,
)
from envs.calculator import CalculatorEnv
from envs.episode_limits import UNKNOWN_CONTEXT_TOKENS
from treetrain.errors import ConfigError
from treetrain.trajectory import Role


def _tool_episode() -> TokenEnv:
    env = TokenEnv(FlakyToolsEnv(), tokenizer(), WrapperConfig())
    env.reset(seed=0)
    return env


def test_segments_alternate_and_carry_the_fed_tokens() -> None:
    env = _tool_episode()
    fed: list[int] = list(env.context)
    turns = [
        "Let me use a tool.\n" + format_tool_call("ok", {"x": 3}),
        format_tool_call("boom", {}),
        "The answer is 6.",
    ]
    for i, text in enumerate(turns):
        tokens = encode(text + END)
        logprobs = [-0.1 * (i + 1)] * len(tokens)
        result = env.step(tokens, logprobs)
        fed += [*tokens, *result.observation]
    traj = env.trajectory("t", model_version=7)
    (call,) = traj.calls
    assert call.tokens == tuple(fed) == env.context
    assert [s.role for s in call.segments] == [Role.PROMPT] + [Role.POLICY, Role.OBSERVATION] * 2 + [
        Role.POLICY
    ]
    policy = [s for s in call.segments if s.role is Role.POLICY]
    assert [s.tokens for s in policy] == [encode(t + END) for t in turns]
    assert [s.logprobs[0] for s in policy if s.logprobs] == pytest.approx([-0.1, -0.2, -0.3])
    assert traj.meta.env == "FlakyToolsEnv" and traj.meta.seed == 0 and traj.meta.model_version == 7
    assert traj.meta.extra["finish"] == "done" and traj.meta.extra["turns"] == "3"


def test_trajectory_text_equals_the_template_rendering() -> None:
    """Tokens built from pieces decode to exactly what the chat template renders for the conversation."""
    env = _tool_episode()
    for text in ["Thinking.\n" + format_tool_call("ok", {"x": 4}), "8"]:
        env.step(encode(text + END))
    rendered = env.template.render(env.messages, env.env.tool_specs())
    assert env.template.decode(env.context) + "\n" == rendered


def test_observation_is_the_template_delta() -> None:
    env = TokenEnv(FixedTurnsEnv(turns=5), tokenizer())
    env.reset(0)
    result = env.step(encode("hi" + END))
    assert (
        env.template.decode(result.observation)
        == "\n<|im_start|>user\nturn 1 ok<|im_end|>\n<|im_start|>assistant\n"
    )


def test_max_turns_ends_the_episode() -> None:
    env = TokenEnv(FixedTurnsEnv(turns=100), tokenizer(), WrapperConfig(EpisodeLimits(max_turns=2)))
    env.reset(0)
    assert not env.step(encode("a" + END)).done
    result = env.step(encode("b" + END))
    assert result.done and result.finish is Finish.MAX_TURNS and result.observation == ()
    with pytest.raises(RuntimeError, match="after done"):
        env.step(encode("c" + END))


def test_turn_cut_by_its_budget_gets_the_end_marker_as_observation() -> None:
    env = TokenEnv(FixedTurnsEnv(turns=5), tokenizer(), WrapperConfig(EpisodeLimits(max_turn_tokens=4)))
    env.reset(0)
    assert env.turn_budget() == 4
    with pytest.raises(ValueError, match=r"1\.\.4 tokens"):
        env.step(encode("a long turn that does not fit" + END))
    cut = encode("abcdefgh")[:4]
    result = env.step(cut)
    assert result.observation[0] == env.template.end_of_turn_id
    assert env.template.decode(result.observation).startswith(END + "\n<|im_start|>user\n")


def test_episode_token_budget() -> None:
    probe = TokenEnv(FixedTurnsEnv(turns=100), tokenizer())
    prompt_len = len(probe.reset(0))
    env = TokenEnv(
        FixedTurnsEnv(turns=100),
        tokenizer(),
        WrapperConfig(EpisodeLimits(max_episode_tokens=prompt_len + 40)),
    )
    env.reset(0)
    assert env.turn_budget() == 40
    result = env.step(encode("x" + END))
    assert not result.done and env.turn_budget() == 40 - 2 - len(result.observation)
    while not result.done:
        result = env.step(encode("x" + END)[-min(2, env.turn_budget()) :])
    assert result.finish is Finish.MAX_TOKENS
    assert len(env.context) < prompt_len + 40
    assert env.trajectory("t").meta.extra["finish"] == "max_tokens"
    with pytest.raises(ValueError, match="leaves no room"):
        TokenEnv(
            FixedTurnsEnv(), tokenizer(), WrapperConfig(EpisodeLimits(max_episode_tokens=prompt_len))
        ).reset(0)


def test_fork_is_independent() -> None:
    env = TokenEnv(FixedTurnsEnv(turns=3), tokenizer())
    env.reset(0)
    env.step(encode("first" + END))
    twin = env.fork()
    twin.step(encode("second" + END))
    assert isinstance(env.env, FixedTurnsEnv) and isinstance(twin.env, FixedTurnsEnv)
    assert len(twin.context) > len(env.context) and env.env.count == 1 and twin.env.count == 2
    env.step(encode("other" + END))
    assert env.context[: len(twin.context)] != twin.context


def test_environment_bug_propagates() -> None:
    class Buggy(FixedTurnsEnv):
        def step(self, message: Message) -> StepResult:
            raise ZeroDivisionError("bug")

    for timeout in (None, 1.0):
        env = TokenEnv(Buggy(), tokenizer(), WrapperConfig(EpisodeLimits(step_timeout_s=timeout)))
        env.reset(0)
        with pytest.raises(EnvStepError, match="ZeroDivisionError"):
            env.step(encode("x" + END))


def test_reset_must_open_with_system_or_user() -> None:
    class Bad(FixedTurnsEnv):
        def reset(self, seed: int) -> Sequence[Message]:
            return (Message("assistant", "hi"),)

    with pytest.raises(EnvStepError, match="system/user"):
        TokenEnv(Bad(), tokenizer()).reset(0)


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ({"max_turns": 0}, r"^max_turns: must be in \[1, 4096\], got 0$"),
        ({"max_turns": 4097}, r"^max_turns: must be in \[1, 4096\], got 4097$"),
        ({"max_turn_tokens": -1}, r"^max_turn_tokens: must be in \[1, 1048576\], got -1$"),
        ({"max_episode_tokens": 1.5}, r"^max_episode_tokens: must be an integer, got 1.5$"),
        ({"max_episode_tokens": 1 << 25}, r"^max_episode_tokens: must be in \[1, 16777216\]"),
        ({"max_turns": True}, r"^max_turns: must be an integer, got True$"),
        ({"step_timeout_s": 0.0}, r"^step_timeout_s: must be in \(0, 604800\] seconds or null"),
        ({"step_timeout_s": 1e9}, r"^step_timeout_s: must be in \(0, 604800\] seconds or null"),
    ],
)
def test_limits_are_validated_naming_the_field(field: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EpisodeLimits(**field)  # type: ignore[arg-type]


def test_limits_at_their_bounds_are_accepted() -> None:
    """The negative control of the refusals above: the largest values and null are valid."""
    limits = EpisodeLimits(
        max_turns=4096, max_turn_tokens=1 << 20, max_episode_tokens=1 << 24, step_timeout_s=None
    )
    assert limits.episode_tokens() == 1 << 24
    assert EpisodeLimits(step_timeout_s=604800.0).step_timeout_s == 604800.0


def test_a_null_episode_budget_is_the_model_context() -> None:
    assert EpisodeLimits().for_context(2048).max_episode_tokens == 2048
    assert EpisodeLimits(max_episode_tokens=512).for_context(2048).max_episode_tokens == 512
    assert EpisodeLimits().for_context(None).max_episode_tokens == UNKNOWN_CONTEXT_TOKENS
    assert (
        EpisodeLimits().for_context(1 << 30).max_episode_tokens == 1 << 24
    )  # a declared context past the limit
    env = TokenEnv(FixedTurnsEnv(), tokenizer(), WrapperConfig(EpisodeLimits().for_context(64)))
    env.reset(0)
    assert env.episode_tokens == 64 and env.turn_budget() == min(96, 64 - len(env.context))


def test_wrapper_config_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"^max_tool_result_chars: must be a positive integer, got 0$"):
        WrapperConfig(max_tool_result_chars=0)
    assert WrapperConfig(max_tool_result_chars=1).max_tool_result_chars == 1


def test_calculator_prompt_lists_the_tool() -> None:
    env = TokenEnv(CalculatorEnv(), tokenizer())
    text = env.template.decode(env.reset(0))
    assert '"name": "calculate"' in text and text.endswith("<|im_start|>assistant\n")
