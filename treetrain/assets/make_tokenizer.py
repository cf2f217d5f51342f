"""Build the tiny tokenizer shipped in `treetrain/assets/tokenizer/`.

Run it with `python -m treetrain.assets.make_tokenizer` (it rewrites that directory). The tokenizer is a
byte-level BPE, so every string round-trips, with a small learned vocabulary (about 512 ids) so a
random-init test model stays tiny. It has ChatML special tokens, `<tool_call>`/`</tool_call>` as added
tokens, and a chat template in the Qwen/Hermes style: tools are listed in the system turn and the assistant
calls them with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The template is *append-only*: rendering a conversation and then rendering it with more messages gives a
string that starts with the first rendering. The token-level environment wrapper relies on that to
tokenize only the text that follows an assistant turn.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from treetrain.assets import tokenizer_path
from treetrain.io import atomic_directory

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions to help with the task. Available functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object inside <tool_call></tool_call> tags:\\n"
    '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('a system message may only come first') }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": '"
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- raise_exception('unknown role ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "is",
    "it",
    "and",
    "or",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "what",
    "which",
    "who",
    "how",
    "many",
    "much",
    "compute",
    "calculate",
    "answer",
    "question",
    "result",
    "value",
    "number",
    "total",
    "sum",
    "product",
    "difference",
    "expression",
    "tool",
    "call",
    "function",
    "arguments",
    "name",
    "lookup",
    "table",
    "document",
    "record",
    "item",
    "warehouse",
    "city",
    "code",
    "row",
    "column",
    "key",
    "find",
    "report",
    "final",
    "please",
    "use",
    "you",
    "may",
    "your",
    "only",
    "one",
    "two",
    "three",
    "error",
    "unknown",
    "timed",
    "out",
    "invalid",
    "json",
    "system",
    "user",
    "assistant",
    "true",
    "false",
    "null",
    "Error:",
    "Answer:",
    "The",
    "is",
    "not",
    "found",
    "returns",
    "string",
    "integer",
]


def _corpus() -> list[str]:
    """A deterministic training corpus resembling what the built-in environments produce."""
    lines: list[str] = []
    for a, b in itertools.product(range(0, 100, 7), range(1, 60, 9)):
        lines.append(f"What is ({a} + {b}) * {a % 9 + 2} - {b}? The answer is {(a + b) * (a % 9 + 2) - b}.")
        lines.append(
            f'<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call>'
        )
        lines.append(f'<tool_call>\n{{"name": "lookup", "arguments": {{"code": "W{a:03d}"}}}}\n</tool_call>')
        lines.append(f"| item-{a:04d} | widget {b} | W{b:03d} |\nW{a:03d}: city {b}")
    for i in range(len(_WORDS)):
        lines.append(" ".join(_WORDS[i:] + _WORDS[:i]))
        lines.append(" ".join(w.capitalize() for w in _WORDS[i : i + 12]) + ".")
    return lines


def build(out_dir: Path) -> None:
    """Train the BPE, wrap it as a Hugging Face tokenizer and save it to `out_dir` atomically."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    with atomic_directory(out_dir) as staging:
        hf.save_pretrained(staging)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=tokenizer_path(), help="output directory")
    args = parser.parse_args()
    build(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
