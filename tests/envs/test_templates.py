"""The model's own chat template, token-exact: observation segments are token differences, sampled tokens
stay as sampled, a template that rewrites earlier turns starts a new call, end of turn is any sequence."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from support.env_fixtures import END, FixedTurnsEnv, TurnCount, encode, tiny_model, tokenizer

from envs import (
    ChatTemplate,
    EpisodeLimits,
    Message,
    Rubric,
    StepResult,
    TemplateError,
    TokenEnv,
    ToolCall,
    WrapperConfig,
)
from envs.protocol import Environment
from treetrain.rollout import RolloutConfig, Sampler, SamplerConfig, Sampling, rollout_trees
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.trajectory import Role
from treetrain.tree import build_tree

#: ChatML that drops <think>...</think> from every assistant message but the last one, the way Qwen3 and
#: DeepSeek-R1 templates drop earlier reasoning. With `keep` it keeps them: the append-only control.
DROPS_REASONING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last and not keep %}{{ m.content.split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer_with(template: str) -> Any:
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = template
    return tok


class ThinkEnv(Environment):
    """The user answers each turn; the rubric sees every assistant message."""

    def reset(self, seed: int) -> Sequence[Message]:
        return (Message("user", "Think, then answer."),)

    def step(self, message: Message) -> StepResult:
        return StepResult((Message("user", "again"),))

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"turns": TurnCount()}


@pytest.mark.parametrize("keep", [False, True])
def test_a_template_that_drops_reasoning_starts_a_new_call(keep: bool) -> None:
    tok = _tokenizer_with(("{%- set keep = true %}" if keep else "{%- set keep = false %}") + DROPS_REASONING)
    env = TokenEnv(ThinkEnv(), tok, WrapperConfig(EpisodeLimits(max_turns=3)))
    env.reset(0)
    turns = [
        encode("<think>hmm</think>first" + END),
        encode("<think>more</think>second" + END),
        encode("third" + END),
    ]
    results = [env.step(t) for t in turns]
    traj = env.trajectory("t")
    policy = [s.tokens for c in traj.calls for s in c.segments if s.role is Role.POLICY]
    assert policy == turns  # the sampled tokens, exactly as sampled, whatever the template does
    if keep:  # control: an append-only template gives one call, and its text is the template's rendering
        assert len(traj.calls) == 1 and not any(r.new_call for r in results)
        assert env.template.decode(env.context) + "\n" == env.template.render(env.messages[:-1])
        return
    assert [r.new_call for r in results[:2]] == [True, True] and results[2].done
    assert len(traj.calls) == 3
    for i, call in enumerate(traj.calls[1:], start=1):
        context = call.segments[0]
        assert context.role is Role.PROMPT
        rendered = env.template.tokens(env.messages[: 1 + 2 * i], generation_prompt=True)
        assert context.tokens == rendered and "hmm" not in env.template.decode(context.tokens)
        assert [s.role for s in call.segments] == [Role.PROMPT, Role.POLICY]
    assert traj.calls[-1].tokens == env.context
    build_tree([traj])  # several calls of one trajectory form one valid tree


def test_rollout_with_a_rewriting_template_encodes_each_new_call_from_scratch(tmp_path: Path) -> None:
    summarizes = DROPS_REASONING.replace("m.content.split('</think>')[-1].lstrip()", "'(earlier turn)'")
    tok = _tokenizer_with("{%- set keep = false %}" + summarizes)
    config = RolloutConfig(
        wrapper=WrapperConfig(EpisodeLimits(max_turns=3, max_turn_tokens=5, max_episode_tokens=512)),
        sampler=SamplerConfig(seed=1),
    )
    model = tiny_model()
    (tree,) = rollout_trees(
        model, tok, ThinkEnv, [0], tmp_path, config, env_name="think", engine=HFEngine(model)
    ).trees
    trajs = tree.trajectories()
    assert trajs and all(len(t.calls) == 3 for t in trajs)  # every user reply rewrote the (assistant) history
    for traj in trajs:
        for call in traj.calls:
            assert call.segments[0].role is Role.PROMPT


def test_observation_is_the_token_difference_of_two_renderings() -> None:
    env = TokenEnv(FixedTurnsEnv(turns=5), tokenizer())
    env.reset(0)
    history = [*env.messages]
    result = env.step(encode("hi" + END))
    with_new = env.template.tokens(
        [*history, Message("assistant", "hi"), *result.messages], generation_prompt=True
    )
    without = env.template.tokens([*history, Message("assistant", "hi")])
    assert with_new[: len(without)] == without
    assert result.observation == encode("\n") + with_new[len(without) :]  # ChatML's newline after <|im_end|>


def test_end_of_turn_comes_from_the_template_and_can_be_any_sequence() -> None:
    assert ChatTemplate(tokenizer()).end_of_turn == END
    plain = _tokenizer_with(
        "{% for m in messages %}{{ m.role }}: {{ m.content }} [done]\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tpl = ChatTemplate(plain, end_of_turn=" [done]")
    assert len(tpl.end_of_turn_ids) > 1 and tpl.end_of_turn_ids in tpl.stop_sequences
    env = TokenEnv(FixedTurnsEnv(turns=3), plain, WrapperConfig(end_of_turn=" [done]"))
    env.reset(0)
    turn = encode(" hello [done]")
    result = env.step(turn)
    assert env.messages[1].content == "hello" and not result.done
    assert env.template.decode(result.observation) == "\nuser: turn 1 ok [done]\nassistant:"
    cut = env.step(encode(" unfinished"))  # cut by a budget: the marker is supplied as observation
    assert cut.observation[: len(tpl.end_of_turn_ids)] == tpl.end_of_turn_ids
    with pytest.raises(TemplateError, match="does not end assistant turns"):  # refused when built
        TokenEnv(FixedTurnsEnv(turns=3), plain, WrapperConfig(end_of_turn="<|im_end|>"))


def test_sampler_stops_on_a_multi_token_sequence() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    free = Sampler(model, SamplerConfig(Sampling(temperature=0)), stop_token_ids=(10**6,)).sample(
        None, (5, 6, 7), 1, 8
    )[0]
    stop = free.tokens[2:4]
    out = Sampler(model, SamplerConfig(Sampling(temperature=0)), stop_token_ids=(10**6, stop)).sample(
        None, (5, 6, 7), 1, 8
    )[0]
    assert out.tokens == free.tokens[:4] and out.stopped and not free.stopped


def test_a_template_that_fails_to_render_is_a_template_error() -> None:
    tok = _tokenizer_with("{{ raise_exception('no tools here') }}")
    with pytest.raises(TemplateError, match="no tools here"):
        ChatTemplate(tok)
    with pytest.raises(TemplateError, match="no chat_template"):
        ChatTemplate(_tokenizer_with(""))


def test_malformed_call_error_answers_with_the_call_id() -> None:
    env = TokenEnv(FixedTurnsEnv(turns=3), tokenizer())
    env.reset(0)
    result = env.step(encode("<tool_call>{bad}</tool_call>" + END))
    assert result.messages[0].tool_call_id == "call_0_0"
    assert ToolCall("x", "f").name == "f"


@pytest.mark.launch  # an end-to-end run: it starts its environment worker processes
def test_a_rewriting_template_trains_from_the_cli(tmp_path: Path) -> None:
    """Multi-call trajectories from a template that rewrites earlier turns go through a whole update."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from treetrain.cli.main import main
    from treetrain.train.metrics import read_metrics
    from treetrain.tree.format import load_trees

    tok = _tokenizer_with(
        "{%- set keep = false %}"
        + DROPS_REASONING.replace("m.content.split('</think>')[-1].lstrip()", "'(earlier turn)'")
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    args = ["train", "--run-dir", str(tmp_path / "run"), "--updates", "1", "--no-progress"]
    for s in (
        f"model.path={tmp_path / 'model'}", "env.name=support.env_fixtures:FixedTurnsEnv", "rollout.groups_per_update=1",
        "rollout.fanout.root=2", "rollout.episode.max_turns=3", "rollout.episode.max_turn_tokens=4", "loss.entropy_coef=0.01",
        "advantages.zero_variance=keep", "measure_memory_every=0", "threads=1",
    ):  # fmt: skip
        args += ["--set", s]
    assert main(args) == 0
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert row.version == 1 and row.trajectories == 2
    trees = [t for p in (tmp_path / "run" / "rollouts").glob("**/*.msgpack") for t in load_trees(p)]
    assert {len(traj.calls) for t in trees for traj in t.trajectories()} == {3}
