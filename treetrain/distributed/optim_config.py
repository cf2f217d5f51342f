"""The `optim` settings: which optimizer, its rates and clipping, validated without importing torch.

`treetrain.distributed.backend` builds the optimizer from them; keeping the settings apart lets a config
error be reported before torch loads.

Example:
    >>> OptimizerConfig(lr=3e-5).name
    'adamw'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from treetrain.errors import ConfigError

OptimizerName = Literal["adamw", "sgd"]


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer settings; the DeepSpeed backend writes them into its generated config.

    `name="sgd"` is plain `torch.optim.SGD` (no momentum): one step moves every parameter by exactly
    `-lr * g` (with `grad_clip=0` and `weight_decay=0`), so a wrong gradient *scale* shows in the update.
    AdamW's first step is about `lr * sign(g)` and hides it; the distributed tests therefore compare SGD
    updates. `betas` and `eps` apply to AdamW only.

    These defaults are the trainer's (the `optim` section of `treetrain train`, the demo's learning rate: RL
    moves a trained policy, far below pre-training rates); the config takes them from here, so a file or
    `--set` that names one field leaves the others at the documented values.
    """

    lr: float = 3e-5
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Adam's moment decay rates."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (after the reduction over ranks) to this; 0 disables clipping."""
    name: OptimizerName = "adamw"
    """'adamw' (`torch.optim.AdamW`, decoupled weight decay) or 'sgd' (`torch.optim.SGD` without
    momentum; `weight_decay` is then SGD's L2 term, added to the gradient)."""

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ConfigError(f"optim.name must be 'adamw' or 'sgd', got {self.name!r}")
        if not self.lr > 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas must be two values in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps!r}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("optim.weight_decay and optim.grad_clip must be >= 0")
