"""Where `treetrain train` and `treetrain eval` put the model: the `device` setting.

One process (`distributed.backend: torch`) trains where `device` says. The default, `auto`, takes the GPU
when torch sees one, as a user with one GPU expects, and the CPU otherwise. Under DeepSpeed each rank's
engine places the policy on its launcher's device itself (its accelerator, `cuda:LOCAL_RANK`, or the CPU
with `DS_ACCELERATOR=cpu`), so `device` must stay `auto` there, and the reference model follows the policy.

The name is checked when the config loads (`check_device_name`, without importing torch); whether the
device exists is checked before any model loads (`train_device`), in one line naming what torch sees.

Example:
    >>> check_device_name("cuda:1")
    >>> check_device_name("gpu")
    Traceback (most recent call last):
    ...
    treetrain.errors.ConfigError: device: 'gpu' is not 'auto', 'cpu', 'cuda' or 'cuda:N'
    >>> train_device("cpu")
    device(type='cpu')
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from treetrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEVICE_NAME = re.compile(r"auto|cpu|cuda(:[0-9]{1,4})?")
"""The names `device` takes."""


def check_device_name(name: object) -> None:
    """Refuse a `device` that is not one of the names `DEVICE_NAME` matches."""
    if not isinstance(name, str) or DEVICE_NAME.fullmatch(name) is None:
        raise ConfigError(f"device: {name!r:.40} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")


def train_device(name: str) -> torch.device:
    """The device `name` means on this machine, for one process (`distributed.backend: torch`): `cuda` is
    the launcher's `LOCAL_RANK`-th GPU (0 without a launcher), and `auto` is that GPU when torch sees one,
    else the CPU. Under DeepSpeed the engine places each rank's model, and this is not asked."""
    import torch

    check_device_name(name)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device: {name!r}, but torch {torch.__version__} sees no CUDA device (built for CUDA "
            f"{torch.version.cuda}); use device: cpu, or auto"
        )
    index = int(name.split(":")[1]) if ":" in name else _local_rank(name)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(
            f"device: cuda:{index}, but torch sees {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def _local_rank(name: str) -> int:
    """The launcher's `LOCAL_RANK` (0 without one), which `cuda` and `auto` take as the GPU's index."""
    local = os.environ.get("LOCAL_RANK", "0")
    if not local.isdigit() or len(local) > 4:
        raise ConfigError(
            f"device: {name!r} takes the GPU at the launcher's LOCAL_RANK, which is {local!r:.20}"
        )
    return int(local)


def place(model: object, device: torch.device) -> None:
    """Move `model` to `device` in place; what is no module of its own (the policy with its adapters off, a
    LoRA run's `model.reference=base`) goes where the policy goes."""
    import torch

    if isinstance(model, torch.nn.Module):
        model.to(device)
