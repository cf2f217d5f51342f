"""The LM head as the model applies it: the output projection, then any scalar the model puts on its logits.

Why: the engine computes logprobs from hidden states through the head itself (`treetrain.models.logprobs`),
never through the model's forward, so whatever a family does to its logits after the projection must be
done here too, or training would follow another distribution than the model samples from. The families
that do something do one of three things, all read from the config:

- multiply by a scalar: Cohere and Cohere 2 (`logit_scale`), HyperCLOVA X (`logits_scaling`), Falcon-H1
  (`lm_head_multiplier`);
- divide by a scalar: Granite and its MoE variants, MiniCPM3 (`logits_scaling`, on the hidden states,
  which is the same for a linear head without bias);
- soft-cap: Gemma 2, VaultGemma, Gemma 3n/4, nanochat (`final_logit_softcapping`: `cap * tanh(logits / cap)`).

ModernBERT's decoder runs a prediction head (dense, activation, norm) before its output projection; that
head is kept in front. The support check (`treetrain.models.support`) compares these logits with the
model's own forward, so a family that does something else is refused, not mistrained.

Example:
    >>> import torch
    >>> head = LogitHead(torch.nn.Linear(4, 6, bias=False), LogitTransform(multiplier=0.5, softcap=2.0))
    >>> x = torch.randn(3, 4)
    >>> bool(torch.allclose(head(x), 2.0 * torch.tanh(0.5 * head.proj(x) / 2.0)))
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from treetrain.models.lora import unwrap

#: Model types whose `logits_scaling` multiplies the logits (elsewhere it divides them, as in Granite).
MULTIPLIED_LOGITS_SCALING = frozenset({"hyperclovax"})


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its logits after the projection: `softcap(logits * multiplier)`."""

    multiplier: float = 1.0
    """Scales the logits (Cohere's `logit_scale`; 1 / Granite's `logits_scaling`)."""
    softcap: float | None = None
    """Final soft-capping `cap * tanh(logits / cap)` (Gemma 2's `final_logit_softcapping`), or None."""

    @property
    def identity(self) -> bool:
        return self.multiplier == 1.0 and self.softcap is None

    def describe(self) -> str:
        parts = [f"logits x {self.multiplier:g}"] if self.multiplier != 1.0 else []
        if self.softcap is not None:
            parts.append(f"final soft-cap {self.softcap:g}")
        return ", ".join(parts) or "none"


def logit_transform(config: object) -> LogitTransform:
    """The transform `config`'s family applies to its logits, from its fields (a text config)."""
    mtype = str(getattr(config, "model_type", ""))
    multiplier = 1.0
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        multiplier *= float(scale)
    scaling = getattr(config, "logits_scaling", None)
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and scaling:
        multiplier *= float(scaling) if mtype in MULTIPLIED_LOGITS_SCALING else 1.0 / float(scaling)
    head = getattr(config, "lm_head_multiplier", None)
    if isinstance(head, (int, float)) and not isinstance(head, bool):
        multiplier *= float(head)
    cap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(multiplier, float(cap) if cap else None)


class LogitHead(nn.Module):
    """`pre` (if any), the output projection, then the model's `LogitTransform`: `[..., H] -> [..., V]`."""

    def __init__(self, proj: nn.Module, transform: LogitTransform, pre: nn.Module | None = None) -> None:
        super().__init__()
        self.proj, self.transform, self.pre = proj, transform, pre

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.proj(hidden if self.pre is None else self.pre(hidden))
        t = self.transform
        if t.multiplier != 1.0:
            logits = logits * t.multiplier
        if t.softcap is not None:
            logits = torch.tanh(logits / t.softcap) * t.softcap
        return logits


def output_head(model: PreTrainedModel) -> nn.Module:
    """The model's LM head with its logit transform (the bare projection when there is none)."""
    proj = model.get_output_embeddings()
    if proj is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (LM head)")
    inner = unwrap(model)
    pre = getattr(inner, "lm_head", None)
    # ModernBERT's decoder: `lm_head` is the prediction head and `decoder` the projection.
    pre = (
        pre
        if isinstance(pre, nn.Module) and pre is not proj and getattr(inner, "decoder", None) is proj
        else None
    )
    transform = logit_transform(model.config.get_text_config(decoder=True))
    return proj if transform.identity and pre is None else LogitHead(proj, transform, pre)
