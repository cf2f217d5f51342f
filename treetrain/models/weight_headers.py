"""Names and shapes of the tensors in safetensors files, read from their headers without torch.

A weight file given to `treetrain eval` (a run's `checkpoints/update-XXXXX/model.safetensors`) is untrusted
input: truncated, overwritten or another model's. Loading torch and the model takes seconds before the
weights are read, and then a damaged file raises a safetensors or `size mismatch` traceback. Its header
(the tensor names, shapes and byte ranges) is checked here first: the `safetensors` library validates that
the header is well formed and that its byte ranges cover the file exactly, with its numpy front end, so
torch is not imported. Shapes are then compared with another set of weights (the model the checkpoint
was trained from) name by name.

Every refusal is a `ValueError` of one line naming the file.

Example:
    >>> import pathlib, tempfile
    >>> bad = pathlib.Path(tempfile.mkdtemp()) / "model.safetensors"
    >>> _ = bad.write_bytes(b"\\x08" + bytes(7) + b"not json")
    >>> header_shapes(bad)
    Traceback (most recent call last):
    ValueError: .../model.safetensors: not a complete safetensors file (Error while deserializing header: ...)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from safetensors import SafetensorError, safe_open

from treetrain.io import path_problem

Shapes = Mapping[str, tuple[int, ...]]

_PEFT_PREFIX = "base_model.model."
"""Where PEFT puts the wrapped model's parameters in a `PeftModel`'s state dict."""


def header_shapes(file: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the header of one safetensors file; names that `save_model` left out as
    copies of a shared tensor (listed in the header's metadata) are included with the shape they share."""
    problem = path_problem(file, "file")  # a FIFO would block the reader; a directory is not weights
    if problem is not None:
        raise ValueError(problem)
    try:
        with safe_open(str(file), "numpy") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{file}: not a complete safetensors file ({_line(exc)})") from None
    for alias, kept in metadata.items():
        if kept in shapes and alias not in shapes:
            shapes[alias] = shapes[kept]
    return shapes


def directory_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """The shapes of every tensor over several files (a sharded checkpoint)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(files):
        shapes.update(header_shapes(file))
    return shapes


def base_name(name: str) -> str:
    """The name a parameter of a PEFT-wrapped model has in the wrapped model's own files
    (`base_model.model.x.q_proj.base_layer.weight` -> `x.q_proj.weight`); other names unchanged."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def shape_mismatch(weights: Shapes, model: Shapes) -> str | None:
    """The first tensor that both hold with different shapes, in words, or None. Names only one side has
    are left to the loader: checkpoint formats rename and drop buffers and tied copies."""
    for name in sorted(weights):
        want = model.get(name, model.get(base_name(name)))
        if want is not None and tuple(want) != tuple(weights[name]):
            return f"{name} is {list(weights[name])} in the file but {list(want)} in the model"
    return None


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]
