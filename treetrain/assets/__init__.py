"""Small files shipped inside the package, and where to find them.

There is no model hub in tests or the demo, so the project ships its own tiny tokenizer: a byte-level BPE
with ChatML special tokens and a chat template that renders system/user/assistant/tool messages and tool
calls. `make_tokenizer.py` (next to this file) rebuilds it; the output is checked in.

Example:
    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(tokenizer_path())
    >>> tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    True
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

DEMO_MODEL = _HERE / "demo_model"
"""The shipped demo checkpoint (`model.path: demo`)."""
WIDE_DEMO_MODEL = _HERE / "demo_model_wide"
"""The demo model with 64-dimensional heads, which vLLM's CPU attention serves (`model.path: demo-wide`)."""


def tokenizer_path() -> Path:
    """Directory of the shipped tokenizer, loadable with `AutoTokenizer.from_pretrained`."""
    return _HERE / "tokenizer"


__all__ = ["DEMO_MODEL", "WIDE_DEMO_MODEL", "tokenizer_path"]
