"""Meta's Llama 3 tiktoken file as a Hugging Face tokenizer, with its 256 special tokens.

Meta ships Llama 3 (3.0 to 3.3) checkpoints in its own format with a `tokenizer.model` that is a tiktoken
BPE file: 128,000 ranked byte sequences and nothing else. The 256 special tokens (`<|begin_of_text|>`,
`<|eot_id|>`, `<|python_tag|>`, ... and `<|reserved_special_token_N|>` filling the rest) are not in the
file; Meta's own `llama_models.llama3.tokenizer.Tokenizer` appends them in code, at ids 128,000 to
128,255. A conversion that forgets them (or adds only the few a chat template names) gives a vocabulary
of 128,000 or 128,003, and `<|eot_id|>` at the wrong id: the model's embedding rows no longer match.
`llama3_tokenizer` converts with transformers' own `TikTokenConverter` and appends exactly Meta's list, so
the result has 128,256 ids, the same ids as Meta's tokenizer for every text, and no chat template (attach
one: docs/models.md).

Example:
    >>> tok = llama3_tokenizer()  # the file Meta's `llama-models` package ships
    >>> len(tok), tok.convert_tokens_to_ids("<|eot_id|>"), tok.chat_template is None
    (128256, 128009, True)
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

LLAMA3_VOCAB = 128_256
"""Ids of a Llama 3 tokenizer: 128,000 BPE ranks and 256 special tokens (`config.json`'s `vocab_size`)."""
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
"""The pre-tokenization regex of Llama 3 (`llama_models.llama3.tokenizer.Tokenizer.pat_str`)."""
_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)


def llama3_special_tokens() -> tuple[str, ...]:
    """Meta's 256 special tokens in id order (the first at id 128,000): the named ones, then reserved."""
    reserved = tuple(f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_NAMED_SPECIALS)))
    return _NAMED_SPECIALS + reserved


def default_llama3_file() -> Path:
    """The `tokenizer.model` that Meta's `llama-models` package ships (tokenizer only, no weights)."""
    try:
        import llama_models
    except ImportError:
        raise FileNotFoundError(
            "no Llama 3 tokenizer file given, and the llama-models package that ships one is not installed"
        ) from None
    return Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


def llama3_tokenizer(model_file: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A Hugging Face fast tokenizer from a Llama 3 tiktoken file (default: `default_llama3_file()`).

    BOS is `<|begin_of_text|>`, EOS `<|eot_id|>` (what ends an instruct model's turn). The file is read by
    transformers' tiktoken loader, which parses ranks and never unpickles. A file that does not hold
    128,000 ranks is refused: the special tokens' ids would not be Llama 3's."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = Path(model_file) if model_file is not None else default_llama3_file()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such tokenizer file")
    specials = list(llama3_special_tokens())
    try:
        converted = TikTokenConverter(str(path), pattern=LLAMA3_PATTERN, extra_special_tokens=specials)
        backend = converted.converted()
    except (ValueError, UnicodeDecodeError) as exc:  # a line that is not `base64 rank`
        raise ValueError(f"{path}: not a tiktoken BPE file ({' '.join(str(exc).split())[:120]})") from None
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    if len(tok) != LLAMA3_VOCAB or tok.convert_tokens_to_ids(specials[0]) != LLAMA3_VOCAB - len(specials):
        raise ValueError(
            f"{path}: gives {len(tok):,} ids with the special tokens, not Llama 3's {LLAMA3_VOCAB:,} "
            f"(it holds {len(tok) - len(specials):,} BPE ranks, Llama 3's file holds 128,000)"
        )
    return tok
