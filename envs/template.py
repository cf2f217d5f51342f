"""The model's own chat template, as a source of token *differences*.

Training needs the exact token ids the model saw, so nothing is re-tokenized after the fact:

- the prompt: the template rendering of the opening messages, with the generation prompt;
- the policy tokens: exactly the sampled ids;
- each observation: the tokens that rendering the history *with* the new messages adds to rendering
  it *without* them, preceded by whatever the template puts after the assistant's end-of-turn marker
  (ChatML's newline after `<|im_end|>`).

That is exact when the template only appends. A template that rewrites earlier turns (one that drops
earlier reasoning blocks, or Mistral's, which moves the system prompt to the last user message) is
detected, not papered over: when the rendering with the new turn does not extend the context before it,
or the rendering with the new messages does not extend the one without them, `observation` returns a
`Rewrite` with the whole new context, and the wrapper continues the episode as a new *call* of the same
trajectory (several calls per trajectory: `treetrain.trajectory`).

End of turn is a token sequence. By default it is what the template writes right after an assistant
message's text (up to its first special token: `<|im_end|>`, `<|eot_id|>`, `<｜end▁of▁sentence｜>`,
`</s>`), and the tokenizer's EOS and any extra ids (the model's `generation_config.eos_token_id`) also
end a turn. `end_of_turn=` overrides the template's marker with any text, of any number of tokens. A
template that writes nothing after an assistant message (GLM-4.5 and later) has *open* turns: the token
that opens the next message (`<|observation|>`, `<|user|>`) ends the turn, and the observation starts
after the one the model sampled.

Rendering itself (the text and ids of a conversation, the tool-call format, the extra template variables)
is `envs.template_text.TemplateText`, which `ChatTemplate` extends with turns and their differences.

Example:
    >>> from transformers import AutoTokenizer
    >>> from treetrain.assets import tokenizer_path
    >>> from envs.protocol import Message
    >>> tpl = ChatTemplate(AutoTokenizer.from_pretrained(tokenizer_path()))
    >>> tpl.end_of_turn, tpl.format.name
    ('<|im_end|>', 'hermes')
    >>> history = [Message("user", "hi"), Message("assistant", "hello")]
    >>> tpl.decode(tpl.observation(history, [Message("user", "bye")]).tokens)
    '\\n<|im_start|>user\\nbye<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envs.protocol import Message, ToolCall, ToolSpec
from envs.template_text import RenderError, TemplateError, TemplateText

log = logging.getLogger(__name__)

_PROBE = "PROBE_7c1e"


_WARNED: set[str] = set()
"""Template warnings already logged by this process: a template is checked once per episode (each episode
gets its own environment), and a run would otherwise repeat the same warning every episode."""


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


@dataclass(frozen=True)
class Observation:
    """Tokens to append after a policy turn: the template's continuation of the same context.
    `rendered` is the whole history rendered with the generation prompt (the next turn's `before`)."""

    tokens: tuple[int, ...]
    rendered: str


@dataclass(frozen=True)
class Rewrite:
    """The template rewrote earlier turns: the next call's whole context (prompt role, no loss).
    `rendered` is its text (the next turn's `before`)."""

    tokens: tuple[int, ...]
    rendered: str


class ChatTemplate(TemplateText):
    """Renders messages with a Hugging Face tokenizer's chat template and tokenizes the differences.

    `tool_format` is a name from `envs.formats.FORMATS`, or None/"auto" to detect it from the template.
    `extra_stop_ids` also end a turn (the trainer passes the model's generation_config EOS ids).
    """

    def __init__(
        self,
        tokenizer: Any,
        end_of_turn: str | None = None,
        tool_format: str | None = None,
        extra_stop_ids: Sequence[int] = (),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(tokenizer, tool_format, template_kwargs)
        probe_text = self.render([Message("user", "ping"), Message("assistant", _PROBE)])
        self.openers: dict[str, str] = {}
        """Open turns: the token that opens each next role, which is what ends the assistant's turn."""
        if end_of_turn is None and probe_text.endswith(_PROBE):
            self.openers = self._probe_openers()
            end_of_turn = self.openers["user"]
        self.end_of_turn = end_of_turn if end_of_turn is not None else self._probe_end_of_turn()
        self.end_of_turn_ids = self.encode(self.end_of_turn)
        if not self.end_of_turn_ids:
            raise TemplateError(f"end_of_turn {self.end_of_turn!r} encodes to no tokens")
        eos = getattr(tokenizer, "eos_token_id", None)
        openers = [self.encode(t) for t in self.openers.values()]
        singles = [(int(t),) for t in [*([eos] if isinstance(eos, int) else []), *extra_stop_ids]]
        self.stop_sequences: tuple[tuple[int, ...], ...] = tuple(
            dict.fromkeys([self.end_of_turn_ids, *openers, *singles])
        )
        if not self.openers:
            self._turn_end(
                self.encode(probe_text),
                len(self.tokens([Message("user", "ping")], generation_prompt=True)),
                (self.end_of_turn_ids,),
            )
        self._tools_checked = False
        self.fast = not self.openers and self._probe_fast()
        """Compute observations from the text after the end-of-turn marker (a probe checked that this
        gives the same tokens as tokenizing both renderings whole)."""

    @property
    def open_turns(self) -> bool:
        """The template writes nothing after an assistant message (GLM-4.5 and later): a turn ends with the
        token that opens the next message (`<|observation|>` before tool results, `<|user|>` before a user
        turn), which the model samples and the observation then does not repeat."""
        return bool(self.openers)

    def turn_closer(self, next_role: str = "user") -> str:
        """The text that ends an assistant turn followed by a `next_role` message (for scripted policies)."""
        return self.openers.get(next_role, self.end_of_turn) if self.openers else self.end_of_turn

    def _probe_openers(self) -> dict[str, str]:
        """The first token each role's message starts with, after an assistant message, in an open template."""
        head = [Message("user", "ping"), Message("assistant", _PROBE)]
        call = self.format.read(self.format.write("probe_tool", {}, "c00000000"), 0).message.tool_calls
        calls = call or (ToolCall("call_0_0", "probe_tool", {}),)
        found: dict[str, str] = {}
        for role, messages in (
            ("user", [*head, Message("user", "pong")]),
            (
                "tool",
                [head[0], Message("assistant", "", calls), Message("tool", "pong", tool_call_id=calls[0].id)],
            ),
        ):
            try:
                without, text = self.render(messages[:-1]), self.render(messages)
            except RenderError:
                continue
            rest = self.encode(text[len(without) :]) if text.startswith(without) else ()
            special = self._special_ids()
            first = next((t for t in rest if t in special), None)
            if first is not None:
                found[role] = self.decode([first])
        if "user" not in found:
            raise TemplateError(
                "the chat template writes nothing after an assistant message and no special token before the "
                "next one; set env.end_of_turn to the text that ends a turn"
            )
        return found

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The single-token stop sequences (a multi-token end-of-turn is in `stop_sequences` only)."""
        return tuple(s[0] for s in self.stop_sequences if len(s) == 1)

    @property
    def end_of_turn_id(self) -> int:
        """The first token of the end-of-turn sequence (its only one for single-token markers)."""
        return self.end_of_turn_ids[0]

    def check_tools(self, tools: Sequence[ToolSpec]) -> None:
        """Refuse a template that cannot carry a tool conversation (once per template).

        A template written without tool support drops the assistant's tool calls or the tool results
        (Phi-4's and Gemma's render only user, assistant and system turns), so the agent would call tools
        and never see a result; that is a `TemplateError` naming what was lost. The template's own rendering
        of a call must parse back with the tool-call format: a detected format that cannot read it (a syntax
        no format knows, such as MiniMax-M2's) is a `TemplateError`, a format set by name only a warning. A
        template that shows no tool schemas (DeepSeek V3's) is only logged: the prompt may describe them."""
        if not tools or self._tools_checked:
            return
        probe = ToolSpec(
            "probe_tool_7c1e", "A probe.", {"type": "object", "properties": {"x": {"type": "integer"}}}
        )
        written = self.format.write(probe.name, {"x": 1}, "c00000000")
        calls = self.format.read(written, 0).message.tool_calls or (
            ToolCall("call_0_0", probe.name, {"x": 1}),
        )
        result = Message("tool", _PROBE + "_RESULT", tool_call_id=calls[0].id, name=probe.name)
        opening = [Message("user", "ping")]
        try:
            text = self.render([*opening, Message("assistant", "", calls), result], (probe,))
        except RenderError as exc:
            raise TemplateError(
                f"the chat template cannot render a tool call and its result ({exc})"
            ) from None
        lost = [
            what
            for what, mark in (("tool calls", probe.name), ("tool results", result.content))
            if mark not in text
        ]
        if lost:
            raise TemplateError(
                f"the chat template drops {' and '.join(lost)} (it has no tool support), so the agent would call "
                "tools without seeing their results; give a tokenizer whose chat template renders them (model.tokenizer)"
            )
        self._check_round_trip(opening, calls, probe)
        if self.render(opening, (probe,)) == self.render(opening):
            _warn_once(
                "the chat template does not show tool schemas to the model; describe the tools in the prompt"
            )
        self._tools_checked = True

    def _check_round_trip(self, opening: list[Message], calls: tuple[ToolCall, ...], probe: ToolSpec) -> None:
        before = self.render(opening, (probe,), generation_prompt=True)
        full = self.render([*opening, Message("assistant", "", calls)], (probe,))
        if not full.startswith(before):
            return  # a template that rewrites the opening: the rendered turn cannot be isolated
        turn = full[len(before) :]
        if not self.openers and self.end_of_turn in turn:
            turn = turn[: turn.index(self.end_of_turn)]
        parsed = self.format.read(turn, 0, (probe,))
        if [(c.name, dict(c.arguments)) for c in parsed.message.tool_calls] == [(probe.name, {"x": 1})]:
            return
        problem = (
            f"the chat template writes a tool call as {turn.strip()[:160]!r}, which the {self.format.name!r} "
            "tool-call format does not read back"
        )
        if self._format_chosen:
            _warn_once(f"{problem} (env.tool_format is set by name, so it is used as given)")
            return
        raise TemplateError(f"{problem}; set env.tool_format to the model's format (envs.formats.FORMATS)")

    # ----- turns ------------------------------------------------------------------------------------
    def stop_length(self, tokens: Sequence[int]) -> int:
        """Length of the stop sequence `tokens` ends with (0: the turn was cut, not stopped)."""
        for seq in self.stop_sequences:
            if len(tokens) >= len(seq) and tuple(tokens[len(tokens) - len(seq) :]) == seq:
                return len(seq)
        return 0

    def turn_text(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """The text of sampled policy tokens without the end-of-turn marker, and whether it was there."""
        cut = self.stop_length(tokens)
        return self.decode(tokens[: len(tokens) - cut]), cut > 0

    def observation(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        tools: Sequence[ToolSpec] = (),
        closed: bool = True,
        before: str | None = None,
        stop: Sequence[int] = (),
    ) -> Observation | Rewrite:
        """What follows the last assistant turn of `history` before the next generation.

        `before` is the rendering of `history[:-1]` with the generation prompt, when the caller has it.
        When the turn was cut by a token budget (`closed=False`), the end-of-turn marker was never sampled,
        so it is supplied here, as the first observation tokens. In an open template (`open_turns`) the
        turn's stop token `stop` is the first token of what follows; a different one (the model opened a
        user turn where a tool result follows) makes the next context a `Rewrite`.
        """
        if not history or history[-1].role != "assistant":
            raise TemplateError("observation needs a history that ends with an assistant message")
        before = before if before is not None else self.render(history[:-1], tools, generation_prompt=True)
        without = self.render(history, tools)
        with_new = self.render([*history, *new_messages], tools, generation_prompt=True)
        if self.openers:
            return self._open_difference(before, without, with_new, tuple(stop) if closed else ())
        lead = () if closed else self.end_of_turn_ids
        fast = self._short_difference(before, without, with_new) if self.fast else None
        if fast is not None:
            return Observation(lead + fast, with_new)
        found = self._token_difference(before, without, with_new)
        return found if isinstance(found, Rewrite) else Observation(lead + found, with_new)

    def _token_difference(self, before: str, without: str, with_new: str) -> tuple[int, ...] | Rewrite:
        """The definition: the trailer after the turn's end marker in tokens(without), then the tokens
        that tokens(with_new) adds to tokens(without); a `Rewrite` when either rendering does not extend
        the one before it."""
        before_ids, without_ids, with_ids = self.encode(before), self.encode(without), self.encode(with_new)
        if with_ids[: len(without_ids)] != without_ids or without_ids[: len(before_ids)] != before_ids:
            return Rewrite(with_ids, with_new)
        end = self._turn_end(without_ids, len(before_ids))
        return without_ids[end:] + with_ids[len(without_ids) :]

    def _open_difference(
        self, before: str, without: str, with_new: str, stop: tuple[int, ...]
    ) -> Observation | Rewrite:
        before_ids, without_ids, with_ids = self.encode(before), self.encode(without), self.encode(with_new)
        if with_ids[: len(without_ids)] != without_ids or without_ids[: len(before_ids)] != before_ids:
            return Rewrite(with_ids, with_new)
        added = with_ids[len(without_ids) :]
        if added[: len(stop)] != stop:
            return Rewrite(with_ids, with_new)
        return Observation(added[len(stop) :], with_new)

    def _short_difference(self, before: str, without: str, with_new: str) -> tuple[int, ...] | None:
        """The same tokens as `_token_difference`, tokenizing only the text after the turn's end marker.

        Valid when the marker is a single added token without whitespace stripping, so tokenization splits
        there; `fast` is only on when a probe agrees with the definition. None: use the definition."""
        if not (with_new.startswith(without) and without.startswith(before)):
            return None
        cut = without.rfind(self.end_of_turn, len(before))
        if cut < 0:
            return None
        trailer = without[cut + len(self.end_of_turn) :]
        head, out = self.encode(trailer), self.encode(trailer + with_new[len(without) :])
        return out if out[: len(head)] == head else None

    def _probe_fast(self) -> bool:
        (eot,) = self.end_of_turn_ids if len(self.end_of_turn_ids) == 1 else (None,)
        added = getattr(self.tokenizer, "added_tokens_decoder", {}).get(eot)
        if added is None or getattr(added, "lstrip", True) or getattr(added, "rstrip", True):
            return False
        history = [Message("user", "ping"), Message("assistant", "pong  1")]
        new = [Message("user", " two\n words")]
        texts = (
            self.render(history[:1], generation_prompt=True),
            self.render(history),
            self.render([*history, *new], generation_prompt=True),
        )
        short = self._short_difference(*texts)
        return short is not None and short == self._token_difference(*texts)

    def _turn_end(
        self, rendered: tuple[int, ...], start: int, sequences: Sequence[tuple[int, ...]] = ()
    ) -> int:
        """Index just past the last stop sequence in `rendered[start:]` (the assistant turn's end)."""
        best = -1
        for seq in sequences or self.stop_sequences:
            for i in range(len(rendered) - len(seq), start - 1, -1):
                if rendered[i : i + len(seq)] == seq:
                    best = max(best, i + len(seq))
                    break
        if best < 0:
            raise TemplateError(
                f"the chat template does not end assistant turns with any stop sequence "
                f"{[self.decode(s) for s in sequences or self.stop_sequences]}; set env.end_of_turn to the text it uses"
            )
        return best

    def _probe_end_of_turn(self) -> str:
        """The text the template writes right after an assistant message, up to its first special token."""
        text = self.render([Message("user", "ping"), Message("assistant", _PROBE)])
        at = text.rfind(_PROBE)
        eos = getattr(self.tokenizer, "eos_token", None)
        suffix = self.encode(text[at + len(_PROBE) :]) if at >= 0 else ()
        special = set(getattr(self.tokenizer, "all_special_ids", ())) | {
            i
            for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
            if getattr(t, "special", False)
        }
        for i, tok in enumerate(suffix):
            if tok in special:
                return self.decode(suffix[: i + 1])
        if isinstance(eos, str) and eos:
            return eos
        raise TemplateError(
            "cannot tell how this chat template ends an assistant turn (no special token after the text, and the "
            "tokenizer has no EOS); set env.end_of_turn"
        )
