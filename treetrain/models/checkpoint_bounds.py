"""A local checkpoint directory is untrusted input: its config.json must not size anything by itself.

`from_pretrained` builds the model that config.json describes and then fills it from the weight files; a
parameter the files lack is allocated and initialized. So a config.json with `vocab_size: 2**40` or
`num_hidden_layers: 1e9` would ask for terabytes, or for a billion modules, before anything else fails.
`check_checkpoint(directory)` refuses that first, in time and memory bounded by the files:

- config.json is a regular file of at most `MAX_CONFIG_BYTES`, a JSON object;
- the counts that make modules (`MAX_LAYERS` layers, `MAX_EXPERTS` experts) are bounded, and so is the
  vocabulary (`MAX_VOCAB`), before transformers reads the config (`checkpoint_config`);
- the model is then built on the meta device (no memory), and its parameters must fit in the safetensors
  files at `MIN_BITS_PER_PARAMETER` (which the files' sizes bound);
- a parameter whose name the files hold with another shape is refused, naming both shapes.

Every refusal is a `ValueError` naming the file and the limit.

Example:
    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 10**9}))
    >>> check_checkpoint(d)
    Traceback (most recent call last):
    ValueError: .../config.json: num_hidden_layers = 1000000000 is above the limit of 1024 (treetrain.models.checkpoint_bounds.MAX_LAYERS)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from treetrain.jsonfile import read_json_object
from treetrain.models.weight_headers import directory_shapes

MAX_CONFIG_BYTES = 1 << 20
"""Largest config.json read (real ones are a few KB)."""
MAX_LAYERS = 1024
"""Most layers a config may ask for (the largest released models have under 200)."""
MAX_VOCAB = 1 << 24
"""Largest vocabulary a config may ask for (released tokenizers have under 300,000 entries)."""
MAX_EXPERTS = 4096
"""Most experts per layer a config may ask for (the largest released models have under 400)."""
MIN_BITS_PER_PARAMETER = 4
"""The densest storage of a parameter in a weight file (4-bit quantized blocks): a model may not have more
parameters than its files could hold at that density."""
SLACK_BYTES = 64 << 10
"""Bytes a model may want beyond its weight files: small buffers such as RoPE frequencies."""

_LAYERS = re.compile(r"^(num_hidden_layers|num_layers|n_layer|n_layers|num_decoder_layers)$")
_EXPERTS = re.compile(r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$")


def _config(directory: Path) -> dict[str, Any]:
    return read_json_object(directory / "config.json", max_bytes=MAX_CONFIG_BYTES)


def _check_counts(data: dict[str, Any], path: Path) -> None:
    """Counts that make modules, in the config and its nested sub-configs (`text_config`, ...)."""
    stack = [data]
    while stack:
        current = stack.pop()
        for key, value in current.items():
            if isinstance(value, dict):
                stack.append(value)
                continue
            for pattern, limit, name in (
                (_LAYERS, MAX_LAYERS, "MAX_LAYERS"),
                (_EXPERTS, MAX_EXPERTS, "MAX_EXPERTS"),
            ):
                if not pattern.match(str(key)) or value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{path}: {key} must be a whole number >= 0, got {str(value)[:40]}")
                if value > limit:
                    raise ValueError(
                        f"{path}: {key} = {value} is above the limit of {limit} (treetrain.models.checkpoint_bounds.{name})"
                    )


def checkpoint_config(directory: str | Path) -> PretrainedConfig:
    """The config of a checkpoint directory, read within the limits; any failure is one `ValueError` line."""
    from transformers import AutoConfig

    directory = Path(directory)
    path = directory / "config.json"
    _check_counts(_config(directory), path)
    try:
        with _quiet():
            config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers raises many types (TypeError, KeyError, ...) for bad fields
        raise ValueError(f"{path}: not a usable model config ({_one_line(exc)})") from None
    vocab = getattr(config.get_text_config(decoder=True), "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(
            f"{path}: vocab_size must be a whole number in [1, {MAX_VOCAB}], got {str(vocab)[:40]} "
            "(treetrain.models.checkpoint_bounds.MAX_VOCAB)"
        )
    return config


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings about a hostile config go to stderr beside our one line; the line says it all."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _meta_model(config: PretrainedConfig, path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from treetrain.models.decoder import base_model

    try:
        with torch.device("meta"), _quiet():
            model = AutoModelForCausalLM.from_config(config)
        base_model(model)
    except Exception as exc:  # whatever the family's constructor makes of a hostile config
        raise ValueError(f"{path}: does not describe a supported causal LM ({_one_line(exc)})") from None
    return model


def check_checkpoint(directory: str | Path) -> None:
    """Refuse a checkpoint directory whose config.json asks for more than its weight files hold."""
    directory = Path(directory)
    path = directory / "config.json"
    config = checkpoint_config(directory)
    shapes = directory_shapes(directory.glob("*.safetensors"))
    model = _meta_model(config, path)
    params = dict(model.named_parameters())  # tied parameters once
    count = sum(p.numel() for p in params.values())
    buffers = sum(b.numel() for b in model.buffers())
    held = sum(file.stat().st_size for file in directory.glob("*.safetensors"))
    if count * MIN_BITS_PER_PARAMETER // 8 + buffers > held + SLACK_BYTES:
        raise ValueError(
            f"{path}: describes a model of {count:,} parameters and {buffers:,} buffer elements, more than its "
            f"weight files ({held:,} bytes) hold at {MIN_BITS_PER_PARAMETER} bits a parameter "
            "(treetrain.models.checkpoint_bounds.MIN_BITS_PER_PARAMETER)"
        )
    for name, param in params.items():
        shape = shapes.get(name)
        if shape is not None and shape != tuple(param.shape):
            raise ValueError(
                f"{path}: {name} is {list(param.shape)} by config.json but {list(shape)} in the weight files"
            )
