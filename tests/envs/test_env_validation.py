"""Validation before work: every env.* setting, the model's context, `module:Class` from the current
directory, portable tree file names, and malformed assistant turns kept for rubrics."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.env_fixtures import END, FixedTurnsEnv, TurnCount, encode, tiny_model, tokenizer

import treetrain.train.loop as loop
from envs import Episode, EpisodeLimits, TokenEnv, WrapperConfig, parse_tool_calls, resolve
from treetrain.cli.main import main
from treetrain.rollout import RolloutConfig, rollout_trees
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.train.config import load_config

BAD_SCHEMA_ENV = """
from envs import Message, Tool, ToolEnv, ToolSpec
from envs.calculator.env import ExactAnswer


class BadSchemaEnv(ToolEnv):
    def reset(self, seed):
        return (Message("user", "hi"),)

    def tools(self):
        spec = ToolSpec("pay", "Pay.", {"type": "object", "properties": {"amount": {"type": "float"}}})
        return (Tool(spec, lambda amount: amount),)

    def rubrics(self):
        return {"exact": ExactAnswer()}
"""


@pytest.fixture
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("a model was loaded before the env settings were checked")

    monkeypatch.setattr(loop, "load_models", refuse)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["env.rubric=exakt"],
            "env.rubric: CalculatorEnv has no rubric 'exakt'; known: ['efficient', 'exact']",
        ),
        (["env.kwargs.max_operands=1"], "env.kwargs: environment 'calculator' rejected"),
        (["env.kwargs.colour=3"], "env.kwargs: environment 'calculator' rejected"),
        (["env.name=nosuchenv"], "unknown environment 'nosuchenv'"),
        (["env.max_tool_result_chars=0"], "env.max_tool_result_chars: must be >= 1"),
        (
            ["env.name=badschema_env:BadSchemaEnv"],
            "env.name: environment 'badschema_env:BadSchemaEnv': tool 'pay'",
        ),
    ],
)
def test_env_settings_fail_before_any_model_loads_or_file_is_written(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys,
    no_model_loads: None,
    overrides: list[str],
    message: str,
) -> None:
    (tmp_path / "badschema_env.py").write_text(BAD_SCHEMA_ENV)
    monkeypatch.chdir(tmp_path)
    args = ["train", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_episode_longer_than_the_model_context_is_refused(tmp_path: Path, capsys) -> None:
    """The demo model's context is 1024 tokens (max_position_embeddings)."""
    args = [
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        "rollout.episode.max_episode_tokens=4096",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "rollout.episode.max_episode_tokens: 4096 tokens is longer than the model's context of 1024 tokens"
        in err
    )
    assert not (tmp_path / "run").exists()  # a run that never started leaves nothing
    assert (
        load_config(None, []).rollout.episode.max_episode_tokens is None
    )  # default: the model's own context


def test_module_class_resolves_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_cwd_env.py").write_text("from support.env_fixtures import FixedTurnsEnv as Here\n")
    monkeypatch.chdir(tmp_path)
    # The `treetrain` console script does not put the current directory on sys.path; python -m does.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert resolve("my_cwd_env:Here") is FixedTurnsEnv
    with pytest.raises(ImportError, match="no_such_module"):
        resolve("no_such_module:X")


def test_tree_file_names_are_portable(tmp_path: Path) -> None:
    config = RolloutConfig(
        wrapper=WrapperConfig(EpisodeLimits(max_turns=2, max_turn_tokens=4, max_episode_tokens=512))
    )
    model = tiny_model()
    result = rollout_trees(
        model,
        tokenizer(),
        FixedTurnsEnv,
        [3],
        tmp_path,
        config,
        env_name="my_pkg.envs:Maze",
        engine=HFEngine(model),
    )
    (path,) = result.paths
    assert path.name.startswith("my_pkg.envs_Maze-s3-") and path.is_file()
    assert all(c.isalnum() or c in "._-" for c in path.name)


@pytest.mark.parametrize(
    "text",
    [
        'I will add them. <tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>',
        'I will add them. <tool_call>{"name": "add", "arguments": {"a": 2}}',
        'I will add them. {"name": "add"}</tool_call>',
    ],
)
def test_a_malformed_turn_keeps_its_raw_text_for_rubrics(text: str) -> None:
    parsed = parse_tool_calls(text, turn=0)
    assert parsed.errors and parsed.message.content == text
    env = TokenEnv(FixedTurnsEnv(), tokenizer(), WrapperConfig(EpisodeLimits(max_turns=1)))
    env.reset(0)
    assert env.step(encode(text + END)).done
    episode: Episode = env.episode()
    assert [m.content for m in episode.messages if m.role == "assistant"] == [text]
    assert TurnCount().score(episode) == pytest.approx(0.1)


def test_end_of_turn_is_checked_against_the_template_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import treetrain.train.models as models

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the template settings were checked")

    monkeypatch.setattr(models, "_load", refuse)
    args = ["train", "--run-dir", str(tmp_path / "run"), "--no-progress", "--set", "env.end_of_turn=<done>"]
    assert main(args) == 2
    assert "does not end assistant turns with any stop sequence ['<done>'" in capsys.readouterr().err
    assert main([*args[:-2], "--set", "env.tool_format=chatml"]) == 2
    assert "env.tool_format: must be 'auto' or one of" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # a run that never started leaves nothing
