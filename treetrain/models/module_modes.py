"""Train or eval mode, judged by the modules that run, and a short eval-mode block that gives each module its
own mode back.

A model's mode is not one flag. `nn.Module.train(mode)` sets every submodule, but a wrapper holds a flag of
its own: PEFT's `PeftModel` starts in train mode when it is built, whatever mode the model it wraps is in
(a checkpoint from `from_pretrained` is in eval mode), and the adapter layers PEFT injects start in train
mode too. So `model.training` of a wrapper says nothing about what runs, and the usual probe idiom

    was = model.training; model.eval(); ...; model.train(was)

puts every module of an eval-mode model behind such a wrapper into train mode on the way out, changing what
the model computes where a family behaves differently in training (Gemma 3n's AltUp clamps its coefficients
and bypasses a LoRA adapter on `correction_coefs`; dropout draws masks). `evaluating` records and restores
each module's own flag instead.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1).eval())
    >>> with evaluating(model):
    ...     training(model)
    False
    >>> [m.training for m in model]
    [True, False]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from treetrain.models.lora import unwrap


def training(model: nn.Module) -> bool:
    """Whether any module that runs (inside a PEFT wrapper: the wrapped model's) is in train mode."""
    return any(m.training for m in unwrap(model).modules())


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with every module in eval mode while the block lasts; afterwards each module is back in the
    mode it had (parents first, through `train`, so a module's own `train` override still runs)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, mode in modes:
            if module.training != mode:
                module.train(mode)
