"""Attention states over one key set, and their exact merge: the kernels under shared-past attention.

An attention state is a partial output and the log-sum-exp of its scores over one set of keys. States over
disjoint key sets merge exactly (`merge_states`), and the backward of one key set is the flash-attention
backward run with the *merged* output and log-sum-exp, so each key set can run on its own kernel.

Two backends compute them. On CPU, torch's fused flash-attention kernel (which returns the log-sum-exp,
`aten._scaled_dot_product_flash_attention_for_cpu`, and its backward) does; elsewhere, and when
`FUSED_CPU` is off, a block-by-block plain-PyTorch reference does (`partial_state`, `partial_backward`).
The tests check both against plain attention over the concatenated keys. On CUDA the reference runs: no
fused kernel is wired there yet, and no CUDA run has been made.

Example:
    >>> import torch
    >>> q, k = torch.randn(1, 4, 8, dtype=torch.float64), torch.randn(1, 6, 8, dtype=torch.float64)
    >>> a = partial_state(q, k[:, :2], k[:, :2], 0.5, lambda a, b: None)
    >>> b = partial_state(q, k[:, 2:], k[:, 2:], 0.5, lambda a, b: None)
    >>> whole = partial_state(q, k, k, 0.5, lambda a, b: None)
    >>> bool(torch.allclose(merge_states(*a, *b)[0], whole[0]))
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Score elements per key block of the reference (`rows x block`): bounds its transient scores (1 MiB in
#: float32) at some cost in matmul efficiency.
BLOCK_ELEMENTS = 1 << 18
#: Use torch's fused CPU flash-attention kernel for float32, float64 and bfloat16 on CPU.
FUSED_CPU = True

Mask = Callable[[int, int], torch.Tensor | None]
"""(first key, end key) of a block -> boolean visibility, broadcastable to the block's scores, or None."""

_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets (`out [..., D]`, `lse [...]`); -inf means no keys."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    return out_a * wa + out_b * wb, lse


def _block(rows: int, keys: int) -> int:
    return max(16, min(keys, BLOCK_ELEMENTS // max(1, rows)))


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None, stat: torch.dtype
) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)).to(stat) * scale  # [N, M, b]
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def partial_state(
    q: torch.Tensor,  # [N, M, D]
    k: torch.Tensor,  # [N, L, D]
    v: torch.Tensor,  # [N, L, D]
    scale: float,
    mask: Mask,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` over one key set, block by block: `(out [N, M, D], lse [N, M])`, both in at least
    float32 (float64 stays float64)."""
    stat = torch.promote_types(q.dtype, torch.float32)
    n, m, _ = q.shape
    out = torch.zeros((n, m, v.shape[-1]), dtype=stat, device=q.device)
    lse = torch.full((n, m), float("-inf"), dtype=stat, device=q.device)
    step = _block(n * m, k.shape[1])
    for a in range(0, k.shape[1], step):
        b = min(a + step, k.shape[1])
        s = _scores(q, k[:, a:b], scale, mask(a, b), stat)
        top = s.amax(-1)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        p = torch.exp(s - top[..., None])  # [N, M, b]
        total = p.sum(-1)
        blk_out = torch.matmul(p.to(v.dtype), v[:, a:b]).to(stat) / total.clamp_min(1e-30)[..., None]
        blk_lse = torch.where(total > 0, top + torch.log(total), torch.full_like(total, float("-inf")))
        out, lse = merge_states(out, lse, blk_out, blk_lse)
    return out, lse


def partial_backward(
    q: torch.Tensor,  # [N, M, D]
    k: torch.Tensor,  # [N, L, D]
    v: torch.Tensor,  # [N, L, D]
    lse: torch.Tensor,  # [N, M], of the merged state
    d_out: torch.Tensor,  # [N, M, D]
    delta: torch.Tensor,  # [N, M] = rowsum(d_out * merged out)
    scale: float,
    mask: Mask,
    d_q: torch.Tensor,  # [N, M, D], accumulated into
    d_kv: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None,
) -> None:
    """The flash-attention backward over one key set; `d_kv(a, b, dk, dv)` receives each block's key grads."""
    stat = lse.dtype
    step = _block(q.shape[0] * q.shape[1], k.shape[1])
    for a in range(0, k.shape[1], step):
        b = min(a + step, k.shape[1])
        kb, vb = k[:, a:b], v[:, a:b]
        p = torch.exp(_scores(q, kb, scale, mask(a, b), stat) - lse[..., None])  # [N, M, b]
        dp = torch.matmul(d_out, vb.transpose(-1, -2)).to(stat)
        ds = (p * (dp - delta[..., None])).to(q.dtype)  # [N, M, b]
        d_q.add_(torch.matmul(ds, kb), alpha=scale)
        if d_kv is not None:
            dk = torch.matmul(ds.transpose(-1, -2), q) * scale  # [N, b, D]
            dv = torch.matmul(p.to(d_out.dtype).transpose(-1, -2), d_out)
            d_kv(a, b, dk, dv)


def fused(q: torch.Tensor) -> bool:
    """Whether `q`'s key sets run on the fused CPU kernel."""
    return FUSED_CPU and q.device.type == "cpu" and q.dtype in _FUSED_DTYPES


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def fused_state(
    q: torch.Tensor,  # [B, H, M, D]
    k: torch.Tensor,  # [B, H, L, D]
    v: torch.Tensor,  # [B, H, L, Dv]
    scale: float,
    *,
    causal: bool = False,
    visible: torch.Tensor | None = None,  # [M, L] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused CPU kernel's state `(out [B, H, M, Dv], lse [B, H, M])`; -inf where a row sees no key."""
    mask = None if visible is None else _additive(visible, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    if visible is not None:  # the kernel reports 0, not -inf, for a row without keys
        lse = lse.masked_fill(~visible.any(-1), float("-inf"))
    return out, lse


def fused_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,  # [B, H, M, Dv], the merged output
    lse: torch.Tensor,  # [B, H, M], the merged log-sum-exp
    d_out: torch.Tensor,
    scale: float,
    *,
    causal: bool = False,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dL/dq, dL/dk, dL/dv of one key set, given the merged state."""
    mask = None if visible is None else _additive(visible, q.dtype)
    d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )
    return d_q, d_k, d_v
