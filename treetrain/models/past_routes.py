"""Where a resident past goes when shared-past attention does not read it in place, and the G routing of it.

Why apart from `treetrain.models.shared_past`: these are the paths around the decomposed attention, not
the attention itself. `expanded_past` turns a multi-head latent attention layer's cached latents into keys
and values once per piece; `concatenated` builds the one `[rows, H_kv, P, D]` past of a model whose
attention cannot be split; both route the gradient reaching a piece into its G accumulator (`_Into`), as
the recurrent layers' state reads do (`treetrain.models.recurrent_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from treetrain.models.layer_entry import LayerKV, kv_part
from treetrain.models.shared_past import SharedPast


class _Into(torch.autograd.Function):
    """Identity whose backward adds the incoming gradient into an accumulator instead of passing it on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, acc: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.acc = acc
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.acc.add_(grad)
        return None, None, None


def expanded_past(
    expand: Callable[[torch.Tensor, torch.Tensor], LayerKV],
    past: Sequence[LayerKV],  # per piece, the cached latents `[1, 1, P_i, r]`, `[1, 1, P_i, R]`
    grads: Sequence[LayerKV | None],
    anchor: torch.Tensor,
) -> tuple[tuple[LayerKV, ...], tuple[None, ...]]:
    """Each piece's keys and values, `expand(cached_k, cached_v)` once per piece (never per row), for a layer
    whose cache holds compressed latents (multi-head latent attention: DeepSeek V2/V3, GLM-4-MoE-Lite,
    MiniCPM3, ...). The expansion runs under autograd, so its projection gets the past's share of the
    gradient; a piece's latent gradient goes into its G accumulator (`anchor`, any tensor under autograd,
    keeps that routing in the graph), so the expanded pieces are passed on without accumulators.
    """
    out = []
    for (k, v), acc in zip(past, grads):
        if k.shape[-2] == 0:  # a one-token last piece without its overlap position: no keys to expand
            continue
        if acc is not None and anchor.requires_grad:
            k, v = _Into.apply(k, acc[0], anchor), _Into.apply(v, acc[1], anchor)
        out.append(expand(k, v))
    return tuple(out), (None,) * len(out)


def expanded_in_one_call(
    expand: Callable[[torch.Tensor, torch.Tensor], LayerKV],
    past: Sequence[LayerKV],  # this rank's pieces of a context group's past, latents as in `expanded_past`
    grads: Sequence[LayerKV | None],
    anchor: torch.Tensor,
    like: LayerKV,  # any piece of the past (held here or not): the latents' shapes and dtype
) -> tuple[tuple[LayerKV, ...], tuple[None, ...], torch.Tensor]:
    """`expanded_past` for a context group: the held pieces and one zero position, expanded in one call.

    Why: under ZeRO-3 every call of the expansion gathers its weights in a collective of all ranks, forward
    and backward, so the ranks of a group, which hold different numbers of pieces, must call it alike. The
    returned tie (zero, but computed from the extra position's expansion) is to be added to the layer's
    output: it keeps that call's backward on every rank, whether its pieces reach the attention or not.
    """
    ks, vs = [], []
    for (k, v), acc in zip(past, grads):
        if acc is not None and anchor.requires_grad:
            k, v = _Into.apply(k, acc[0], anchor), _Into.apply(v, acc[1], anchor)
        ks.append(k)
        vs.append(v)
    zk, zv = (torch.zeros((*t.shape[:-2], 1, t.shape[-1]), dtype=t.dtype, device=anchor.device) for t in like)
    keys, values = expand(torch.cat([*ks, zk], dim=-2), torch.cat([*vs, zv], dim=-2))
    sizes = [int(k.shape[-2]) for k in ks] + [1]
    split = list(zip(keys.split(sizes, dim=-2), values.split(sizes, dim=-2)))
    extra_k, extra_v = split.pop()
    return tuple(split), (None,) * len(split), (extra_k.sum() + extra_v.sum()) * 0.0


def concatenated(past: SharedPast, rows: int, anchor: torch.Tensor | None) -> list[LayerKV | None]:
    """The past as one `[rows, H_kv, P, D]` tensor per layer (the path for attention that cannot be split);
    None for a recurrent layer, which reads its state from the last piece itself.

    Gradients reaching a piece with an accumulator are added into it; `anchor` (any tensor under autograd)
    keeps that routing in the graph.
    """
    n_layers = len(past.pieces[0])
    grads = past.grads or (None,) * len(past.pieces)
    out: list[LayerKV | None] = []
    for layer in range(n_layers):
        if layer in past.recurrent:
            out.append(None)
            continue
        ks, vs = [], []
        for piece, acc in zip(past.pieces, grads):
            k, v = kv_part(piece[layer])
            if acc is not None and anchor is not None and anchor.requires_grad:
                gk, gv = kv_part(acc[layer])
                k, v = _Into.apply(k, gk, anchor), _Into.apply(v, gv, anchor)
            ks.append(k)
            vs.append(v)
        k, v = (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks, dim=-2), torch.cat(vs, dim=-2))
        out.append((k.expand(rows, *k.shape[1:]), v.expand(rows, *v.shape[1:])))
    return out
