"""Logprobs of chosen target tokens without materializing `[B, T, V]` float32 logits.

Only positions that predict a loss-carrying token need logits at all, so callers gather those hidden
states first (`[N, H]`). The head then runs over row chunks sized so one chunk's float32 logits stay under
`max_logit_elements`; under autograd each chunk is checkpointed, so backward recomputes the chunk's logits
instead of keeping them alive.

`temperature` divides the logits before the log-softmax (and the entropy), as the sampler divided them
before drawing: a rollout sampled at temperature T drew from softmax(logits / T), and the loss must score
that distribution for its ratio, its KL and its correction to be on policy (TRL and verl divide the same way).
The division is in place on the chunk's fresh logits, so it costs no second `[C, V]` buffer.

Example:
    >>> import torch
    >>> head = torch.nn.Linear(8, 50, bias=False)
    >>> lp, ent = target_logprobs(head, torch.randn(5, 8), torch.tensor([1, 2, 3, 4, 5]),
    ...                            vocab_size=50, with_entropy=True)
    >>> lp.shape, ent.shape, bool((lp <= 0).all())
    (torch.Size([5]), torch.Size([5]), True)
    >>> hot, _ = target_logprobs(head, torch.randn(5, 8), torch.tensor([1, 2, 3, 4, 5]), vocab_size=50,
    ...                          temperature=0.5)
    >>> hot.shape
    torch.Size([5])
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from treetrain.models import DEFAULT_MAX_LOGIT_ELEMENTS


def _chunk_stats(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden)  # [C, V]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:  # in place: no op before it keeps its output for backward
        logits = logits.div_(temperature)
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [C]
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)  # [C, V]
        entropy = lse - (probs * logits).sum(-1)  # [C]
    else:
        entropy = torch.zeros_like(logp)
    return logp, entropy


def target_logprobs(
    head: nn.Module,
    hidden: torch.Tensor,  # [N, H]
    targets: torch.Tensor,  # [N]
    *,
    vocab_size: int,
    with_entropy: bool = False,
    max_logit_elements: int = DEFAULT_MAX_LOGIT_ELEMENTS,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log p(target | position) (at least float32) for each row under softmax(logits / `temperature`), and
    that distribution's entropy if asked.

    `vocab_size` comes from the model config: under ZeRO-3 the head's weight is partitioned and its shape
    says nothing about the vocabulary.
    """
    n = hidden.shape[0]
    if n == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    rows = max(1, max_logit_elements // vocab_size)
    logps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
    # Under ZeRO-3 DeepSpeed frees a module's parameters after its forward, in the recompute too, and
    # gathers them again before the module's backward: a recomputed saved parameter can be empty when
    # torch compares shapes (after the recompute), never when the backward uses it.
    check = "none" if any(hasattr(p, "ds_id") for p in head.parameters()) else "default"
    for start in range(0, n, rows):
        h, t = hidden[start : start + rows], targets[start : start + rows]
        if use_ckpt:
            lp, ent = checkpoint(
                _chunk_stats, head, h, t, with_entropy, temperature, use_reentrant=False,
                determinism_check=check,
            )  # fmt: skip
        else:
            lp, ent = _chunk_stats(head, h, t, with_entropy, temperature)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps)
    return logp, (torch.cat(ents) if with_entropy else None)
