"""The weight files `treetrain eval` is given, checked from their headers before torch loads.

A run's checkpoint holds only `model.safetensors`, loaded over the model the run's `config.yaml` names;
`final/` (or any model directory) holds a whole model. A truncated or overwritten file, or the weights of
another model, would otherwise be found seconds later, after torch and the model load, as a safetensors or
`size mismatch` traceback. Here every weight file must be a complete safetensors file, and every tensor it
shares by name with the weights of the run's starting model (`model.path`, when that is a directory with
safetensors files) must have that tensor's shape. What the headers cannot tell (names in another layout, a
tiny-<family> preset without files) is refused when the weights are loaded (`load_checkpoint_weights`).

Example:
    >>> from treetrain.train.config import ModelSection
    >>> check_weight_files([DEMO_MODEL / "model.safetensors"], ModelSection(path="demo-wide"))
    Traceback (most recent call last):
    treetrain.errors.ConfigError: --model: .../model.safetensors does not hold weights of the run's model (demo-wide): model.layers.0.self_attn.k_proj.weight is [128, 128] in the file but [512, 128] in the model
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treetrain.assets import DEMO_MODEL, WIDE_DEMO_MODEL
from treetrain.errors import ConfigError
from treetrain.models.weight_headers import directory_shapes, shape_mismatch
from treetrain.train.config import ModelSection


def model_weight_files(path: str) -> list[Path]:
    """The safetensors files of `model.path` (none for a tiny-<family> preset, which has no files)."""
    directory = {"demo": DEMO_MODEL, "demo-wide": WIDE_DEMO_MODEL}.get(path)
    if directory is None:
        if path.startswith("tiny-"):
            return []
        directory = Path(path)
    return sorted(directory.glob("*.safetensors")) if directory.is_dir() else []


def check_weight_files(files: Sequence[Path], trained: ModelSection | None, flag: str = "--model") -> None:
    """Refuse weight files that are damaged, or whose tensors have other shapes than `trained`'s starting
    model (None: the run is unknown; only the files' own integrity is checked)."""
    try:
        shapes = directory_shapes(files)
        base_files = model_weight_files(trained.path) if trained is not None else []
        model = directory_shapes(base_files) if base_files else {}
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    mismatch = shape_mismatch(shapes, model)
    if mismatch is not None and trained is not None:
        where = files[0] if len(files) == 1 else files[0].parent
        raise ConfigError(
            f"{flag}: {where} does not hold weights of the run's model ({trained.path}): {mismatch}"
        )


def load_checkpoint_weights(policy: Any, weights: Path, flag: str = "--model") -> None:
    """Load a run checkpoint's `model.safetensors` into `policy` (strict); weights that do not fit it (a
    name missing or left over, another shape) are one line naming the file and the first difference."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    try:
        load_model(policy, str(weights))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(
            f"{flag}: {weights}: not a complete safetensors file ({_first_line(exc)})"
        ) from None
    except RuntimeError as exc:
        raise ConfigError(
            f"{flag}: {weights} does not hold weights of the run's model: {_first_line(exc)}"
        ) from None


def _first_line(exc: BaseException) -> str:
    """The first line that says what differs (torch lists every mismatched parameter on its own line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if line.startswith(("size mismatch", "Missing key", "Unexpected key"))]
    text = (useful or lines or [type(exc).__name__])[0]
    return text if len(text) <= 240 else text[:237] + "..."
