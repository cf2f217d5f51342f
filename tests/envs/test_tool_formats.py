"""Tool-call formats: each round-trips through its family's chat template (render a call, parse it back,
same call), is detected from the template, runs a calculator episode token-exactly, and turns a parse
failure into an `Error: ...` tool message."""

from __future__ import annotations

import copy

import pytest
from support.chat_formats import family_tokenizer

from envs import EpisodeLimits, Message, TokenEnv, ToolCall, WrapperConfig
from envs.calculator import CalculatorEnv
from envs.formats import FORMATS, UnknownFormatError, get_format
from envs.template import ChatTemplate
from treetrain.trajectory import Role

NAMES = ["hermes", "llama3", "mistral", "deepseek_v3"]
CALLS = [
    ("calculate", {"expression": "17 * 23"}),
    (
        "book",
        {"city": "Zürich", "nights": 2, "guests": [{"name": "Ada", "age": 36}], "late": True, "note": None},
    ),
]
BAD = {
    "hermes": '<tool_call>{"name": "calculate", "arguments": {"expression": </tool_call>',
    "llama3": '{"name": "calculate", "parameters": {"expression": ',
    "mistral": '[TOOL_CALLS] [{"name": "calculate", "arguments": {"expression": "1"}',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculate\n```json\n{oops}\n```"
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}


@pytest.mark.parametrize("name", NAMES)
def test_format_is_detected_from_the_template(name: str) -> None:
    tpl = ChatTemplate(family_tokenizer(name))
    assert tpl.format.name == name
    assert tpl.end_of_turn == {"hermes": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}.get(
        name, "<｜end▁of▁sentence｜>"
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("call", CALLS, ids=["simple", "nested"])
def test_a_call_rendered_by_the_template_parses_back_to_the_same_call(name: str, call: tuple) -> None:
    tpl = ChatTemplate(family_tokenizer(name))
    call_id = "c00000000" if name == "mistral" else "call_0_0"
    opening = [Message("user", "Please do it.")]
    before = tpl.render(opening, generation_prompt=True)
    rendered = tpl.render([*opening, Message("assistant", "", (ToolCall(call_id, *call),))])
    assert rendered.startswith(before)
    turn = rendered[len(before) :]
    turn = turn[: turn.rindex(tpl.end_of_turn)]  # what the model wrote before its end-of-turn marker
    parsed = tpl.format.parse(turn, 0)
    assert parsed.errors == ()
    ((got_name, got_args),) = [(c.name, dict(c.arguments)) for c in parsed.message.tool_calls]
    assert (got_name, got_args) == call
    again = tpl.format.parse(
        tpl.write_call(*call, call_id=call_id), 0
    ).message.tool_calls  # the writer agrees
    assert [(c.name, dict(c.arguments)) for c in again] == [call]


@pytest.mark.parametrize("name", NAMES)
def test_calculator_episode_in_each_format(name: str) -> None:
    tok = family_tokenizer(name)
    env = TokenEnv(CalculatorEnv(), tok, WrapperConfig(EpisodeLimits(max_turns=4)))
    prompt = env.reset(seed=5)
    task = env.env.state()
    assert task is not None
    end = env.template.end_of_turn
    first = env.template.encode(env.template.write_call("calculate", {"expression": task.expression}) + end)
    result = env.step(first)
    assert [m.content for m in result.messages] == [str(task.answer)], result.messages
    assert str(task.answer) in env.template.decode(result.observation)
    final = env.template.encode(f"The answer is {task.answer}." + end)
    assert env.step(final).done
    traj = env.trajectory("t")
    policy = [s.tokens for c in traj.calls for s in c.segments if s.role is Role.POLICY]
    assert policy == [first, final] and traj.reward == 1.0
    assert traj.calls[0].tokens[: len(prompt)] == prompt
    # Mistral's template moves the system prompt to the last user message: a rewrite, so a second call.
    assert len(traj.calls) == (2 if name == "mistral" else 1)


@pytest.mark.parametrize("name", NAMES)
def test_a_parse_failure_is_an_error_tool_message(name: str) -> None:
    tok = family_tokenizer(name)
    env = TokenEnv(CalculatorEnv(), tok, WrapperConfig(EpisodeLimits(max_turns=4)))
    env.reset(seed=1)
    result = env.step(env.template.encode(BAD[name] + env.template.end_of_turn))
    assert result.messages and result.messages[0].role == "tool"
    assert result.messages[0].content.startswith("Error: malformed tool call")
    assert env.messages[-2].content == BAD[name].strip()  # the raw attempt stays for rubrics
    if result.done:  # Mistral's template cannot render a turn whose only call was malformed
        assert name == "mistral" and result.finish is not None and result.finish.value == "template_error"


def test_format_by_name_and_unknown_names() -> None:
    assert get_format("llama3") is FORMATS["llama3"]
    with pytest.raises(
        UnknownFormatError,
        match="known: \\['deepseek_v3', 'glm45', 'hermes', 'llama3', 'mistral', 'qwen3_coder'\\]",
    ):
        get_format("chatml")
    tpl = ChatTemplate(family_tokenizer("hermes"), tool_format="llama3")
    assert tpl.format.name == "llama3"


def test_llama3_takes_one_call_per_turn() -> None:
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'
    parsed = FORMATS["llama3"].parse(text, 0)
    assert [c.name for c in parsed.message.tool_calls] == ["a"]
    assert "one tool call per turn" in parsed.errors[0].problem
    plain = FORMATS["llama3"].parse("The answer is 4.", 0)
    assert plain.message.content == "The answer is 4." and not plain.errors


def _scripted_episode(name: str, fast: bool | None, seed: int = 5) -> tuple:
    env = TokenEnv(
        CalculatorEnv(), family_tokenizer(name), WrapperConfig(EpisodeLimits(max_turns=4, max_turn_tokens=64))
    )
    if fast is not None:
        env.template.fast = fast
    env.reset(seed=seed)
    task = env.env.state()
    assert task is not None
    end = env.template.end_of_turn
    call = env.template.encode(env.template.write_call("calculate", {"expression": task.expression}))
    env.step(call + env.template.end_of_turn_ids)
    assert not env.step(call[:-3]).done  # cut by its budget: no end marker, a malformed call
    env.step(env.template.encode(f"{task.answer}" + end))
    return env.template.fast if fast is None else fast, env.trajectory("t").calls


@pytest.mark.parametrize("name", NAMES)
def test_short_difference_gives_the_tokens_of_the_definition(name: str) -> None:
    """Differential: observations from the text after the end marker equal the token difference of the
    two whole renderings, turn by turn, in every format (with a cut turn in between)."""
    probed, fast_calls = _scripted_episode(name, None)
    assert probed  # the probe enabled the short path for all four families
    _, exact_calls = _scripted_episode(name, False)
    assert fast_calls == exact_calls


def test_the_differential_check_catches_a_wrong_short_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a short path that loses the template's trailer is caught by the comparison."""
    right = _scripted_episode("hermes", True)[1]
    real = ChatTemplate._short_difference

    def wrong(self, before: str, without: str, with_new: str):  # type: ignore[no-untyped-def]
        out = real(self, before, without, with_new)
        return None if out is None else out[1:]

    monkeypatch.setattr(ChatTemplate, "_short_difference", wrong)
    assert _scripted_episode("hermes", True)[1] != right


def test_a_multi_token_end_marker_uses_the_definition() -> None:
    tok = copy.deepcopy(family_tokenizer("hermes"))
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }} [done]\n{% endfor %}assistant:"
    assert not ChatTemplate(tok, end_of_turn=" [done]").fast


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", '<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>"),
        ("mistral", "[TOOL_CALLS] " + "[" * 200_000),
        ("llama3", '{"name": "add", "parameters": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001),
    ],
    ids=["long-integer", "deep-list", "deep-object"],
)
def test_json_the_decoder_cannot_read_is_a_malformed_call_not_an_exception(name: str, text: str) -> None:
    """Python's own decoder limits (integer digits, recursion depth) end in an `Error: ...` message."""
    turn = FORMATS[name].read(text, turn=0)
    assert not turn.message.tool_calls
    assert [e.problem for e in turn.errors] == [turn.errors[0].problem]
    assert "unparseable tool call" in turn.errors[0].problem or "invalid JSON" in turn.errors[0].problem
    assert turn.errors[0].to_message().content.startswith("Error: malformed tool call")
