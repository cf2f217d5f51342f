"""Loading the policy, the reference model and the tokenizer named by a `ModelSection`."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from treetrain.assets import DEMO_MODEL, WIDE_DEMO_MODEL, tokenizer_path
from treetrain.errors import ConfigError
from treetrain.io import atomic_directory, path_problem
from treetrain.models.checkpoint_bounds import checkpoint_config
from treetrain.models.lora import AdaptersOff, Reference, apply_lora, peft_quiet
from treetrain.models.presets import load_model, model_config
from treetrain.models.tokenizer_files import TokenizerFileError, check_tokenizer_dir, load_failure
from treetrain.models.weight_headers import directory_shapes
from treetrain.train.config import ModelSection


@dataclass(frozen=True)
class LoadedModels:
    policy: PreTrainedModel
    """The policy; a PEFT `PeftModel` with `model.lora` (only its adapters trainable)."""
    reference: Reference | None
    tokenizer: PreTrainedTokenizerBase
    tokenizer_fingerprint: str


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of the vocabulary, special tokens and chat template: resident state is only valid under it."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def resolve_model_path(path: str, field: str = "model.path") -> str:
    """The checkpoint directory for `path` ('demo', a preset name, or a local directory; no hub)."""
    if path in ("demo", "demo-wide"):
        where = DEMO_MODEL if path == "demo" else WIDE_DEMO_MODEL
        if not (where / "config.json").is_file():
            raise ConfigError(f"{field}: the {path} checkpoint is missing at {where}")
        return str(where)
    if not path.startswith("tiny-") and not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"{field}: {path!r} is not a model directory (no config.json there); give a local Hugging Face "
            "checkpoint directory, 'demo', 'demo-wide', or a tiny-<family> preset"
        )
    if not path.startswith("tiny-"):
        try:  # before a tokenizer or anything else reads it
            checkpoint_config(path)
        except ValueError as exc:
            raise ConfigError(f"{field}: {exc}") from None
    return path


def check_tokenizer_fits(tokenizer_ids: int, model_ids: int) -> None:
    """Refuse a tokenizer that makes ids the model has no embedding row for, naming both numbers.

    A conversion that loses special tokens, or a tokenizer of another model, fails here instead of at the
    first prompt that holds such an id. A larger embedding is common (rows padded to a multiple of 64)."""
    if tokenizer_ids > model_ids:
        raise ConfigError(
            f"model.tokenizer: the tokenizer has {tokenizer_ids:,} ids but the model's vocabulary is "
            f"{model_ids:,} (config.json vocab_size), so ids from {model_ids:,} on have no embedding row; save "
            "the model with vocab_size >= len(tokenizer), or give the tokenizer it was trained with"
        )


def broken_weights(directory: str) -> str:
    """Which safetensors file in `directory` is unreadable (a header check, no tensor is read)."""
    try:
        directory_shapes(Path(directory).glob("*.safetensors"))
    except ValueError as exc:
        return str(exc)
    return f"{directory}: its weights cannot be read"


def _load(path: str, field: str, section: ModelSection, vocab_size: int) -> PreTrainedModel:
    """`load_model` with every failure of reading the checkpoint as a one-line `ConfigError` naming `field`."""
    try:
        return load_model(path, vocab_size=vocab_size, dtype=getattr(torch, section.dtype), attn=section.attn)
    except ConfigError:
        raise
    except SafetensorError:
        raise ConfigError(f"{field}: {broken_weights(path)}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{field}: {' '.join(str(exc).split())}") from None


def load_models(
    section: ModelSection,
    check_tokenizer: Callable[[Any], None] | None = None,
    vocab_size: int | None = None,
    check_config: Callable[[PretrainedConfig], None] | None = None,
) -> LoadedModels:
    """The policy, the reference and the tokenizer. `check_tokenizer(tokenizer)` and then
    `check_config(text config)` (read without weights: the vocabulary, the context) run before any model is
    built or sized, so trees can be checked against the vocabulary first.

    `vocab_size` sizes a tiny-<family> preset (default: the tokenizer's length; `treetrain plan --model`
    sizes it from the trees, as without a config)."""
    path = resolve_model_path(section.path)
    if section.tokenizer is not None:
        tok_dir: Any = section.tokenizer
    elif path.startswith("tiny-"):
        tok_dir = tokenizer_path()
    else:
        tok_dir = path
    field = "model.tokenizer" if section.tokenizer is not None else "model.path"
    problem = path_problem(tok_dir, "directory")  # before Hugging Face takes a missing path for a repo id
    if problem is not None:
        raise ConfigError(f"{field}: {problem}; give a local tokenizer directory")
    try:  # before transformers reads a byte of it
        check_tokenizer_dir(tok_dir)
    except TokenizerFileError as exc:
        raise ConfigError(f"{field}: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    # transformers and tokenizers raise many types (even a bare Exception) for bad tokenizer files
    except Exception as exc:
        raise ConfigError(f"{field}: {load_failure(tok_dir, exc)}") from None
    if check_tokenizer is not None:
        check_tokenizer(tokenizer)
    vocab = vocab_size if vocab_size is not None and path.startswith("tiny-") else len(tokenizer)
    try:
        config = model_config(path, vocab_size=vocab, attn=section.attn)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: {' '.join(str(exc).split())}") from None
    if not path.startswith("tiny-"):  # a preset is sized from the tokenizer (or, in `plan`, the trees)
        check_tokenizer_fits(len(tokenizer), int(config.vocab_size))
    if check_config is not None:
        check_config(config)
    policy = _load(path, "model.path", section, vocab)
    if section.lora is not None:
        policy = apply_lora(policy, section.lora)
    reference: Any = None
    if section.reference == "base":
        return LoadedModels(policy, AdaptersOff(policy), tokenizer, tokenizer_fingerprint(tokenizer))
    if section.reference == "initial":
        reference = copy.deepcopy(policy)
    elif section.reference is not None:
        reference = _load(
            resolve_model_path(section.reference, "model.reference"),
            "model.reference",
            section,
            vocab,
        )
    if reference is not None:
        reference.eval()
        reference.requires_grad_(False)
    return LoadedModels(policy, reference, tokenizer, tokenizer_fingerprint(tokenizer))


def export_merged(section: ModelSection, adapter_dir: Path, out_dir: Path, tokenizer: Any = None) -> None:
    """A plain Hugging Face model with the trained adapters of `adapter_dir` merged into the base weights.

    The base is loaded afresh from `section.path`, so the training model (partitioned or not) is untouched.
    """
    from peft import PeftModel

    vocab = len(tokenizer) if tokenizer is not None else 0
    base = _load(resolve_model_path(section.path), "model.path", section, vocab)
    with peft_quiet():
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    with atomic_directory(out_dir) as tmp:
        merged.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
