"""A conversation as the model's chat template writes it: the text, its token ids, and the tool-call format.

`TemplateText` is the rendering half of `envs.template.ChatTemplate`: it checks that the tokenizer has a
chat template and that the extra template variables are ones treetrain may pass, picks the tool-call format
(`envs.formats`), and renders messages to text and ids. Where a turn ends, and which tokens an observation
adds, are `ChatTemplate`'s; keeping rendering apart lets the configuration check the template variables
(`template_kwargs_problem`) without the rest.

Example:
    >>> from transformers import AutoTokenizer
    >>> from treetrain.assets import tokenizer_path
    >>> from envs.protocol import Message
    >>> text = TemplateText(AutoTokenizer.from_pretrained(tokenizer_path()))
    >>> text.render([Message("user", "hi")], generation_prompt=True)
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from envs.formats import ToolCallFormat, detect_format, get_format
from envs.protocol import Message, ToolSpec
from treetrain.errors import TreetrainError


class TemplateError(TreetrainError, ValueError):
    """The tokenizer's chat template is missing, fails to render, or has no usable end-of-turn marker."""


class RenderError(TemplateError):
    """The chat template refused one conversation (its own `raise_exception`, or a Jinja error)."""


class TemplateText:
    """Renders messages with a Hugging Face tokenizer's chat template, and encodes and decodes its text.

    `tool_format` is a name from `envs.formats.FORMATS`, or None/"auto" to detect it from the template.
    """

    def __init__(
        self,
        tokenizer: Any,
        tool_format: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                f"{type(tokenizer).__name__} has no chat_template; give a tokenizer that has one (model.tokenizer)"
            )
        self.tokenizer = tokenizer
        problem = template_kwargs_problem(template_kwargs or {})
        if problem:
            raise TemplateError(f"template_kwargs: {problem}")
        self.template_kwargs = dict(template_kwargs or {})
        """Extra template variables (`enable_thinking=False`, ...) passed on every rendering."""
        named = tokenizer.chat_template  # a dict of named templates: `tool_use` renders tool conversations
        text = named.get("tool_use") or named.get("default") if isinstance(named, dict) else named
        self.format: ToolCallFormat = (
            detect_format(str(text or "")) if tool_format in (None, "auto") else get_format(str(tool_format))
        )
        self._format_chosen = tool_format not in (None, "auto")

    def _payload(self, message: Message) -> dict[str, Any]:
        out = message.to_openai()
        if self.format.arguments_as_string and message.tool_calls:
            for call in out["tool_calls"]:
                call["function"]["arguments"] = json_dumps(call["function"]["arguments"])
        return out

    def render(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), generation_prompt: bool = False
    ) -> str:
        """The template text of `messages`, with the assistant generation prompt when asked."""
        try:
            text = self.tokenizer.apply_chat_template(
                [self._payload(m) for m in messages],
                tools=[t.to_openai() for t in tools] or None,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self.template_kwargs,
            )
        except Exception as exc:  # jinja2 errors and the template's own raise_exception
            raise RenderError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise TemplateError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of a piece of template text (special tokens are matched, none are added)."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=False))

    def tokens(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), generation_prompt: bool = False
    ) -> tuple[int, ...]:
        return self.encode(self.render(messages, tools, generation_prompt))

    def prompt_tokens(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> tuple[int, ...]:
        """The prompt segment: opening messages plus the generation prompt."""
        return self.tokens(messages, tools, generation_prompt=True)

    def _special_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "all_special_ids", ())) | {
            i
            for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
            if getattr(t, "special", False)
        }

    def write_call(self, name: str, arguments: dict[str, Any], call_id: str = "call_0_0") -> str:
        """The text this model writes to call a tool (for scripted policies and tests)."""
        return self.format.write(name, arguments, call_id)


_RESERVED = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def template_kwargs_problem(kwargs: Mapping[str, Any]) -> str | None:
    """Why `kwargs` cannot be extra chat-template variables (one line), or None when they can.

    >>> template_kwargs_problem({"enable_thinking": False}) is None, template_kwargs_problem({"tools": []})
    (True, "'tools' is set by treetrain itself; give only the template's own variables")
    """
    if not isinstance(kwargs, Mapping):
        return f"must be a mapping of names to values, got {type(kwargs).__name__}"
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            return f"{key!r} is not a template variable name"
        if key in _RESERVED:
            return f"{key!r} is set by treetrain itself; give only the template's own variables"
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            return f"{key!r}: not a JSON value ({exc})"
    return None


def json_dumps(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
