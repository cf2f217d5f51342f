"""`treetrain.models.tokenizers.llama3_tokenizer` gives Meta's Llama 3 tokenizer, id for id.

Meta's own `llama_models.llama3.tokenizer.Tokenizer` is the reference: the same special tokens at the same
ids, and the same ids for text that mixes words, numbers, whitespace, non-ASCII and special tokens. The
conversion without the special tokens (what a hand conversion gets) is the negative control: it does not
reach 128,256 ids, and `<|eot_id|>` is not a single token there."""

from __future__ import annotations

from pathlib import Path

import pytest

from treetrain.models.tokenizers import (
    LLAMA3_PATTERN,
    LLAMA3_VOCAB,
    default_llama3_file,
    llama3_special_tokens,
    llama3_tokenizer,
)

TEXTS = [
    "Hi there!  123 ümlaut\n\n<|python_tag|>",
    '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{"x": 12345.5}<|eot_id|>',
    "   leading spaces, tabs\tand CRLF\r\n, 日本語, emoji 🙂, <|reserved_special_token_250|>",
]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return llama3_tokenizer()


def test_ids_equal_metas_tokenizer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from llama_models.llama3.tokenizer import Tokenizer

    meta = Tokenizer(default_llama3_file())
    assert len(tokenizer) == LLAMA3_VOCAB == meta.n_words
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in llama3_special_tokens()} == meta.special_tokens
    assert Tokenizer.pat_str == LLAMA3_PATTERN
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == meta.encode(
            text, bos=False, eos=False, allowed_special="all"
        )
    assert tokenizer.eos_token == "<|eot_id|>" and tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.chat_template is None


def test_without_the_special_tokens_the_vocabulary_is_wrong() -> None:
    """Negative control: transformers' converter alone, as a hand conversion calls it."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(str(default_llama3_file()), pattern=LLAMA3_PATTERN).converted()
    bare = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert len(bare) != LLAMA3_VOCAB
    assert len(bare.encode("<|eot_id|>", add_special_tokens=False)) > 1


def test_a_file_of_another_size_is_refused(tmp_path: Path) -> None:
    lines = default_llama3_file().read_text().splitlines()
    short = tmp_path / "tokenizer.model"
    short.write_text("\n".join(lines[:1000]) + "\n")
    with pytest.raises(ValueError, match=r"gives 1,256 ids with the special tokens, not Llama 3's 128,256"):
        llama3_tokenizer(short)


@pytest.mark.parametrize("content", ["not base64 at all\n", "aGk= notanumber\n"])
def test_a_file_that_is_not_tiktoken_is_one_line(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "tokenizer.model"
    bad.write_text(content)
    with pytest.raises(ValueError) as refused:
        llama3_tokenizer(bad)
    assert str(refused.value).startswith(f"{bad}: ") and "\n" not in str(refused.value)


def test_a_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such tokenizer file"):
        llama3_tokenizer(tmp_path / "nothing.model")
