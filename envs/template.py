"""The chat template, seen as a source of token *deltas*.

Training needs the exact token ids the model saw, so text is tokenized once, in pieces, and never again:

- the prompt: the template rendering of the opening messages, with the generation prompt;
- each observation: the template text that follows the assistant turn's end-of-turn marker, up to and
  including the next generation prompt (tool results, role headers, separators).

The policy tokens in between are the sampled ids themselves. This needs an *append-only* template: adding
messages must only append text. ChatML templates (Qwen, Hermes, the shipped one) are; a template that
rewrites history (e.g. drops earlier reasoning) is rejected with `TemplateError` instead of silently
producing tokens the model never saw.

Example:
    >>> from transformers import AutoTokenizer
    >>> from treetrain.assets import tokenizer_path
    >>> from envs.protocol import Message
    >>> tpl = ChatTemplate(AutoTokenizer.from_pretrained(tokenizer_path()))
    >>> history = [Message("user", "hi"), Message("assistant", "hello")]
    >>> tpl.decode(tpl.observation_tokens(history, [Message("user", "bye")], closed=True))
    '\\n<|im_start|>user\\nbye<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envs.protocol import Message, ToolSpec


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be used incrementally (or is missing)."""


class ChatTemplate:
    """Renders messages with a Hugging Face tokenizer's chat template and tokenizes the deltas.

    `end_of_turn` is the text the model emits to end its turn (a single token); sampling stops on it.
    """

    def __init__(self, tokenizer: Any, end_of_turn: str = "<|im_end|>") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"{type(tokenizer).__name__} has no chat_template")
        ids = tokenizer.encode(end_of_turn, add_special_tokens=False)
        if len(ids) != 1:
            raise TemplateError(f"end_of_turn {end_of_turn!r} is {len(ids)} tokens; it must be exactly one")
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn
        self.end_of_turn_id: int = ids[0]
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([self.end_of_turn_id, *([eos] if eos is not None else [])])
        )

    def render(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), generation_prompt: bool = False
    ) -> str:
        """The template text of `messages`, with the assistant generation prompt when asked."""
        text = self.tokenizer.apply_chat_template(
            [m.to_openai() for m in messages],
            tools=[t.to_openai() for t in tools] or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        if not isinstance(text, str):
            raise TemplateError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of a piece of template text (special tokens are matched, none are added)."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=False))

    def prompt_tokens(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> tuple[int, ...]:
        """The prompt segment: opening messages plus the generation prompt."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def turn_text(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """The text of sampled policy tokens without the end-of-turn marker, and whether it was there."""
        closed = bool(tokens) and tokens[-1] in self.stop_token_ids
        return self.decode(tokens[:-1] if closed else tokens), closed

    def observation_tokens(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        tools: Sequence[ToolSpec] = (),
        closed: bool = True,
    ) -> tuple[int, ...]:
        """Tokens between the end of the last assistant turn in `history` and the next generation.

        When the turn was cut by a token budget (`closed=False`) the end-of-turn marker was never sampled,
        so it is supplied here, as an observation token, before the template's own delta.
        """
        if not history or history[-1].role != "assistant":
            raise TemplateError("observation_tokens needs a history that ends with an assistant message")
        before = self.render(history[:-1], tools, generation_prompt=True)
        prefix = self.render(history, tools, generation_prompt=False)
        full = self.render([*history, *new_messages], tools, generation_prompt=True)
        if not prefix.startswith(before) or not full.startswith(prefix):
            raise TemplateError("the chat template is not append-only: adding messages changed earlier text")
        cut = prefix.rfind(self.end_of_turn)
        if cut < len(before):
            raise TemplateError(f"the template does not end assistant turns with {self.end_of_turn!r}")
        delta = full[cut + len(self.end_of_turn) :]
        return self.encode(delta if closed else self.end_of_turn + delta)
