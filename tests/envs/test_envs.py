"""Protocol conformance of every built-in environment, and tool failures becoming observations."""

from __future__ import annotations

import doctest
import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import pytest
from support.env_fixtures import END, FixedTurnsEnv, FlakyToolsEnv, encode, tokenizer

from envs import (
    BUILTINS,
    ConformanceError,
    Environment,
    EpisodeLimits,
    Message,
    Rubric,
    StepResult,
    TokenEnv,
    WrapperConfig,
    check_environment,
    format_tool_call,
    make_env,
)

TASKS = str(Path(__file__).resolve().parents[1] / "assets" / "tasks.jsonl")
SMALL: dict[str, dict[str, object]] = {
    "calculator": {},
    "lookup": {"num_rows": 12, "num_warehouses": 4},
    "dataset": {"path": TASKS},
    "longdoc": {"num_tokens": 1024},
}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_conforms(name: str) -> None:
    check_environment(lambda: make_env(name, **SMALL[name]), reward_range=(0.0, 1.0), tokenizer=tokenizer())


def test_every_builtin_has_small_settings_here() -> None:
    assert set(SMALL) == set(BUILTINS)


class _SharedStateEnv(FixedTurnsEnv):
    """Broken on purpose: every fork shares one counter, so forks are not independent."""

    shared: ClassVar[list[int]] = [0]

    def step(self, message: Message) -> StepResult:
        self.shared[0] += 1
        return StepResult((Message("user", str(self.shared[0])),), done=self.shared[0] % 5 == 0)


class _NondeterministicEnv(FixedTurnsEnv):
    calls: ClassVar[list[int]] = [0]

    def reset(self, seed: int) -> Sequence[Message]:
        self.calls[0] += 1
        return (Message("user", f"task {self.calls[0]}"),)


class _RaisingRubric(Rubric):
    def score(self, episode: object) -> float:  # type: ignore[override]
        return float("nan")


class _NaNRewardEnv(FixedTurnsEnv):
    def rubrics(self) -> Mapping[str, Rubric]:
        return {"nan": _RaisingRubric()}


@pytest.mark.parametrize(
    ("env_cls", "problem"),
    [
        (_SharedStateEnv, "fork is not independent"),
        (_NondeterministicEnv, "reset is not deterministic"),
        (_NaNRewardEnv, "rubric 'nan'"),
    ],
)
def test_conformance_catches_broken_environments(env_cls: type[Environment], problem: str) -> None:
    """Negative controls: each check fails on an environment that breaks it."""
    with pytest.raises(ConformanceError, match=problem):
        check_environment(env_cls, seeds=(0,))


def test_fixture_environment_conforms() -> None:
    check_environment(FixedTurnsEnv, tokenizer=tokenizer())


# ----- tool failures become observations ----------------------------------------------------------
def _episode(timeout: float | None = 0.5) -> TokenEnv:
    env = TokenEnv(
        FlakyToolsEnv(), tokenizer(), WrapperConfig(EpisodeLimits(max_turns=10, step_timeout_s=timeout))
    )
    env.reset(seed=0)
    return env


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>{"name": "ok", "arguments": {"x": 2</tool_call>', "malformed tool call (invalid JSON"),
        ('<tool_call>["ok", 2]</tool_call>', "expected a JSON object"),
        ('<tool_call>{"name": "ok", "arguments": {"x": 2}}', "<tool_call> without </tool_call>"),
        (format_tool_call("nope", {}), "unknown tool 'nope'. Available tools: boom, ok, slow."),
        (format_tool_call("ok", {"y": 1}), "missing required argument(s) ['x']"),
        (format_tool_call("ok", {"x": "two"}), "argument 'x': 'two' is not of type 'integer'"),
        (format_tool_call("boom", {}), "tool 'boom' raised RuntimeError: the tool exploded"),
        (format_tool_call("slow", {"seconds": 2.0}), "tool 'slow' timed out after 0.2s"),
    ],
)
def test_tool_failure_is_an_observation(text: str, expected: str) -> None:
    env = _episode(timeout=0.2)
    result = env.step(encode(text + END))
    assert not result.done
    assert len(result.messages) == 1 and result.messages[0].role == "tool"
    assert expected in result.messages[0].content
    assert expected in env.template.decode(result.observation)
    # The episode goes on: a working call and a final answer still succeed.
    assert env.step(encode(format_tool_call("ok", {"x": 21}) + END)).messages[0].content == "42"
    assert env.step(encode("done" + END)).done


def test_valid_and_malformed_calls_in_one_turn() -> None:
    env = _episode()
    text = format_tool_call("ok", {"x": 1}) + '<tool_call>{"name": }</tool_call>'
    result = env.step(encode(text + END))
    contents = [m.content for m in result.messages]
    assert contents[1] == "2" and contents[0].startswith("Error: malformed tool call")
    assert not result.done


def test_working_tool_control() -> None:
    """Control for the failure cases: the same environment answers a good call with its result."""
    result = _episode().step(encode(format_tool_call("ok", {"x": 5}) + END))
    assert [m.content for m in result.messages] == ["10"]


def test_timeout_keeps_the_pre_step_environment() -> None:
    env = _episode(timeout=0.1)
    before = env.env
    env.step(encode(format_tool_call("slow", {"seconds": 1.0}) + END))
    assert env.env is before


MODULES = [
    "envs.protocol",
    "envs.tools",
    "envs.tool_schema",
    "envs.formats",
    "envs.toolcalls",
    "envs.template",
    "envs.template_text",
    "envs.wrapper",
    "envs.registry",
    "envs.calculator.arith",
    "envs.lookup.table",
    "envs.longdoc.document",
    "treetrain.assets",
    "treetrain.rollout.fanout",
    "treetrain.rollout.prefix_sampler",
    "treetrain.rollout.importer",
]


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module: str) -> None:
    failed, attempted = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert failed == 0
    assert attempted > 0 or module == "envs.protocol"


def test_documented_example_environment_conforms() -> None:
    """The custom-environment example in docs/environments.md runs and passes the conformance checks."""
    page = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    section = page[page.index("## The protocol") :]
    code = section[
        section.index("```python") + len("```python") : section.index("```\n", section.index("```python") + 9)
    ]
    assert len(code.strip().splitlines()) <= 40
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/environments.md", "exec"), namespace)
    env_cls = namespace["EchoEnv"]
    assert isinstance(env_cls, type) and issubclass(env_cls, Environment)
    check_environment(env_cls, reward_range=(0.0, 1.0), tokenizer=tokenizer())


def test_docstring_examples_of_the_environment_api_run() -> None:
    import doctest

    import envs.tools

    result = doctest.testmod(envs.tools)
    assert result.attempted >= 8 and result.failed == 0
