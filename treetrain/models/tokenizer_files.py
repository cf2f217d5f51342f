"""A tokenizer directory is untrusted input: it is checked here before transformers reads a byte of it.

transformers' tokenizer loading trusts its files. A `tokenizer.json` of a model type the `tokenizers` library
does not know ends in `KeyError: 'added_tokens'`; a `tokenizer_config.json` nested 100,000 deep in a
`RecursionError`; a FIFO or `/dev/zero` in place of `tokenizer.json` is passed over, and the error then
blames a missing `sentencepiece`; an `auto_map` asks for code from the directory to be run, and the error
suggests `trust_remote_code=True`. `check_tokenizer_dir` is the one check every verb that takes a tokenizer
runs first (`treetrain inspect --tokenizer`, and `treetrain plan` and `train` through
`treetrain.train.models.load_models`):

- every file transformers may read there is a regular file (a link to one is fine: the Hugging Face cache
  is made of links), of at most `MAX_TOKENIZER_FILE_BYTES`;
- every JSON file is a JSON object nested at most `MAX_JSON_DEPTH` deep (real ones: under 10);
- `tokenizer.json` names a model type the `tokenizers` library has (`MODEL_TYPES`) and lists its added
  tokens;
- no `auto_map` (code to run from the directory) in `tokenizer_config.json` or `config.json`: refused,
  since treetrain never runs code from a model directory.

Each refusal is a `TokenizerFileError`, one line naming the file.

Example:
    >>> import json, pathlib, shutil, tempfile
    >>> from treetrain.assets import tokenizer_path
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "tok"
    >>> _ = shutil.copytree(tokenizer_path(), d)
    >>> check_tokenizer_dir(d)
    >>> _ = (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}))
    >>> check_tokenizer_dir(d)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    treetrain.models.tokenizer_files.TokenizerFileError: .../tokenizer_config.json: has an auto_map (code to run from the tokenizer directory: x.Tok); treetrain refuses tokenizers that need their own code
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from treetrain.errors import TreetrainError
from treetrain.io import path_problem
from treetrain.jsonfile import read_json_object

MAX_TOKENIZER_FILE_BYTES = 256 << 20
"""Largest tokenizer file read (the largest released `tokenizer.json` files are about 35 MB)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of a tokenizer's JSON file (real ones nest under 10 deep)."""
JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "chat_template.json",
    "config.json",
    "generation_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)
"""The JSON files `AutoTokenizer.from_pretrained` may read from a directory."""
OTHER_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.txt", "merges.txt")
"""Its other files (SentencePiece and tiktoken models, vocabularies, merges); also `*.jinja`, `*.tiktoken`."""
MODEL_TYPES = ("BPE", "WordPiece", "WordLevel", "Unigram")
"""The model types of the `tokenizers` library (`tokenizer.json` field `model.type`)."""
AUTO_MAP_FILES = ("tokenizer_config.json", "config.json")


class TokenizerFileError(TreetrainError, ValueError):
    """A tokenizer directory is refused; the message names the file and the problem."""


def check_tokenizer_dir(directory: str | os.PathLike[str]) -> None:
    """Refuse `directory` unless every tokenizer file in it is safe for transformers to read."""
    root = Path(directory)
    if (problem := path_problem(root, "directory")) is not None:
        raise TokenizerFileError(problem)
    names = [*JSON_FILES, *OTHER_FILES]
    try:
        names += sorted(p.name for p in root.iterdir() if p.suffix in (".jinja", ".tiktoken"))
    except OSError as exc:
        raise TokenizerFileError(f"{root}: cannot list it ({exc.strerror})") from None
    for name in names:
        _check_file(root / name)
    for name in JSON_FILES:
        if os.path.lexists(root / name):
            data = _read(root / name)
            if name in AUTO_MAP_FILES:
                _refuse_auto_map(root / name, data)
            if name == "tokenizer.json":
                _check_fast_tokenizer(root / name, data)


def _check_file(path: Path) -> None:
    if not os.path.lexists(path):
        return
    try:
        info = path.stat()  # a link is followed: what transformers would open
    except OSError as exc:
        raise TokenizerFileError(f"{path}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO, device or socket"
        raise TokenizerFileError(f"{path}: not a regular file ({kind}); a tokenizer file must be one")
    if info.st_size > MAX_TOKENIZER_FILE_BYTES:
        raise TokenizerFileError(
            f"{path}: {info.st_size:,} bytes, larger than a tokenizer file may be ({MAX_TOKENIZER_FILE_BYTES:,}; "
            "treetrain.models.tokenizer_files.MAX_TOKENIZER_FILE_BYTES)"
        )


def _read(path: Path) -> dict[str, Any]:
    data = read_json_object(path, max_bytes=MAX_TOKENIZER_FILE_BYTES, error=TokenizerFileError)
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise TokenizerFileError(f"{path}: nested {depth} deep, deeper than the limit of {MAX_JSON_DEPTH}")
    return data


def json_depth(value: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _refuse_auto_map(path: Path, data: dict[str, Any]) -> None:
    if "auto_map" not in data:
        return
    named = data["auto_map"]
    shown = ", ".join(
        sorted({str(v) for vs in named.values() for v in (vs if isinstance(vs, list) else [vs]) if v})
    )
    raise TokenizerFileError(
        f"{path}: has an auto_map (code to run from the tokenizer directory{': ' + shown[:80] if isinstance(named, dict) else ''}); "
        "treetrain refuses tokenizers that need their own code"
    )


def _check_fast_tokenizer(path: Path, data: dict[str, Any]) -> None:
    model = data.get("model")
    kind = model.get("type") if isinstance(model, dict) else None
    if kind not in MODEL_TYPES:
        found = "no model.type" if kind is None else f"model.type {str(kind)[:40]!r}"
        raise TokenizerFileError(
            f"{path}: {found}, not one of the tokenizers library's model types ({', '.join(MODEL_TYPES)})"
        )
    if not isinstance(data.get("added_tokens"), list):  # transformers reads it unchecked (KeyError)
        raise TokenizerFileError(f"{path}: added_tokens must be a list (of the added tokens; [] for none)")


def load_failure(directory: str | os.PathLike[str], exc: BaseException) -> str:
    """One line for a tokenizer transformers could not load from a checked directory. transformers' own
    message may suggest `trust_remote_code=True`; treetrain never runs a directory's code, so that
    suggestion is replaced by the refusal.

    Example:
        >>> load_failure("tok", ValueError("Loading tok requires you to execute code. Please pass the argument `trust_remote_code=True`."))
        'cannot load a tokenizer from tok: it needs code of its own to run, which treetrain refuses'
    """
    message = " ".join(str(exc).split())
    if "trust_remote_code" in message:
        return f"cannot load a tokenizer from {directory}: it needs code of its own to run, which treetrain refuses"
    return f"cannot load a tokenizer from {directory}: {type(exc).__name__}: {message[:300]}"
