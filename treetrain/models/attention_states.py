"""Attention states over one key set, and their exact merge: the kernels under shared-past attention.

An attention state is a partial output and the log-sum-exp of its scores over one set of keys. States over
disjoint key sets merge exactly (`merge_states`), and the backward of one key set is the flash-attention
backward run with the *merged* output and log-sum-exp, so each key set can run on its own kernel.

Three backends compute them, chosen by device (`fused`):

- CPU: torch's fused flash-attention kernel, which returns the log-sum-exp
  (`aten._scaled_dot_product_flash_attention_for_cpu`, and its backward, which takes a given output and
  log-sum-exp);
- CUDA (float32, float16, bfloat16): torch's memory-efficient SDPA kernel, which does the same
  (`aten._scaled_dot_product_efficient_attention` with `compute_log_sumexp`, and its backward). It is
  used on a device and dtype only after a probe there (`cuda_kernel_ok`) agrees with the reference,
  forward and backward, on small windowed and causal cases; otherwise a warning says so and the reference
  runs. No CUDA run has been made in this project's tests: the glue (padding, alignment, rows without
  keys) is tested on CPU against an emulation of the kernel's contract.
- anywhere else, and when `FUSED_CPU` / `FUSED_CUDA` is off: a block-by-block plain-PyTorch reference
  (`partial_state`, `partial_backward`).

FlexAttention (`return_aux=AuxRequest(lse=True)`) was not chosen: in torch 2.13 it refuses backward on
CPU (NotImplementedError), so its backward could not be tested here, and a fused flex kernel needs
`torch.compile`, recompiling per query and key length.

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

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Score elements per key block of the reference (`rows x block`): bounds its transient scores (1 MiB in
#: float32) at some cost in matmul efficiency.
BLOCK_ELEMENTS = 1 << 18
#: Use torch's fused CPU flash-attention kernel for float32, float64 and bfloat16 on CPU.
FUSED_CPU = True
#: Use torch's memory-efficient SDPA kernel on CUDA (float32, float16, bfloat16) once its probe agrees.
FUSED_CUDA = True

Mask = Callable[[int, int], torch.Tensor | None]
"""(first key, end key) of a block -> boolean visibility, broadcastable to the block's scores, or None."""

_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LSE_ALIGN = 32  # the efficient kernel's log-sum-exp rows are padded to a multiple of this
_BIAS_ALIGN = 16  # ... and its bias rows must start at multiples of this many elements
# The CUDA kernel's ops, module-level so tests can put an emulation of their contract in their place.
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
_EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward
_PROBED: dict[tuple[str, torch.dtype, int], bool] = {}


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets (`out [..., D]`, `lse [...]`); -inf means no keys."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    return out_a * wa + out_b * wb, lse


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_states` into `out` in place, for a running state whose `lse` is finite in every row (each row
    has seen a key; `lse_b` may be -inf): no -inf guard and no new `[..., D]` buffer per key set."""
    total = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - total)[..., None]).addcmul_(out_b, torch.exp(lse_b - total)[..., None])
    return out, total


def _block(rows: int, keys: int) -> int:
    return max(16, min(keys, BLOCK_ELEMENTS // max(1, rows)))


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    stat: torch.dtype,
    softcap: float | None = None,
) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)).to(stat) * scale  # [N, M, b]
    if softcap is not None:  # Gemma 2's attention soft-capping, before the mask as in its eager attention
        s = torch.tanh(s / softcap) * softcap
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def partial_state(
    q: torch.Tensor,  # [N, M, D]
    k: torch.Tensor,  # [N, L, D]
    v: torch.Tensor,  # [N, L, D]
    scale: float,
    mask: Mask,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` over one key set, block by block: `(out [N, M, D], lse [N, M])`, both in at least
    float32 (float64 stays float64). `softcap` caps the scaled scores, `cap * tanh(s / cap)`."""
    stat = torch.promote_types(q.dtype, torch.float32)
    n, m, _ = q.shape
    out = torch.zeros((n, m, v.shape[-1]), dtype=stat, device=q.device)
    lse = torch.full((n, m), float("-inf"), dtype=stat, device=q.device)
    step = _block(n * m, k.shape[1])
    for a in range(0, k.shape[1], step):
        b = min(a + step, k.shape[1])
        s = _scores(q, k[:, a:b], scale, mask(a, b), stat, softcap)
        top = s.amax(-1)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        p = torch.exp(s - top[..., None])  # [N, M, b]
        total = p.sum(-1)
        blk_out = torch.matmul(p.to(v.dtype), v[:, a:b]).to(stat) / total.clamp_min(1e-30)[..., None]
        blk_lse = torch.where(total > 0, top + torch.log(total), torch.full_like(total, float("-inf")))
        out, lse = merge_states(out, lse, blk_out, blk_lse)
    return out, lse


@dataclass(frozen=True)
class MergedGrad:
    """What every key set's backward reads of the *merged* attention state: its log-sum-exp, the gradient
    of its output, and their row product. It is one for all key sets, which is what lets each run alone."""

    lse: torch.Tensor  # [N, M], of the merged state
    d_out: torch.Tensor  # [N, M, D]
    delta: torch.Tensor  # [N, M] = rowsum(d_out * merged out)


def partial_backward(
    q: torch.Tensor,  # [N, M, D]
    k: torch.Tensor,  # [N, L, D]
    v: torch.Tensor,  # [N, L, D]
    merged: MergedGrad,
    scale: float,
    mask: Mask,
    d_q: torch.Tensor,  # [N, M, D], accumulated into
    d_kv: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None,
    softcap: float | None = None,
) -> None:
    """The flash-attention backward over one key set; `d_kv(a, b, dk, dv)` receives each block's key grads.
    With `softcap`, the score gradient passes through the cap: d(cap * tanh(s / cap))/ds = 1 - tanh^2."""
    lse, d_out, delta = merged.lse, merged.d_out, merged.delta
    stat = lse.dtype
    step = _block(q.shape[0] * q.shape[1], k.shape[1])
    for a in range(0, k.shape[1], step):
        b = min(a + step, k.shape[1])
        kb, vb = k[:, a:b], v[:, a:b]
        capped = _scores(q, kb, scale, mask(a, b), stat, softcap)
        p = torch.exp(capped - lse[..., None])  # [N, M, b]
        dp = torch.matmul(d_out, vb.transpose(-1, -2)).to(stat)
        ds = p * (dp - delta[..., None])  # [N, M, b]
        if softcap is not None:  # masked entries have p = 0; their capped score is -inf, so keep them out
            ds = ds * (1 - torch.nan_to_num(capped / softcap, neginf=0.0) ** 2)
        ds = ds.to(q.dtype)
        d_q.add_(torch.matmul(ds, kb), alpha=scale)
        if d_kv is not None:
            dk = torch.matmul(ds.transpose(-1, -2), q) * scale  # [N, b, D]
            dv = torch.matmul(p.to(d_out.dtype).transpose(-1, -2), d_out)
            d_kv(a, b, dk, dv)


def fused(q: torch.Tensor) -> bool:
    """Whether `q`'s key sets run on a fused kernel (`fused_state`, `fused_backward`) for its device."""
    if q.device.type == "cpu":
        return FUSED_CPU and q.dtype in _FUSED_DTYPES
    if q.device.type == "cuda":
        return FUSED_CUDA and q.dtype in _CUDA_DTYPES and cuda_kernel_ok(q.device, q.dtype, q.shape[-1])
    return False


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def _aligned_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask `[M, L]` in memory whose rows start at multiples of `_BIAS_ALIGN` (a view)."""
    m, n = visible.shape
    width = -(-n // _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.zeros((m, width), dtype=dtype, device=visible.device)
    bias[:, :n].masked_fill_(~visible, float("-inf"))
    return bias[:, :n]


def cuda_state(
    q: torch.Tensor,  # [B, H, M, D]
    k: torch.Tensor,  # [B, H, L, D]
    v: torch.Tensor,  # [B, H, L, Dv]
    scale: float,
    *,
    causal: bool = False,
    visible: torch.Tensor | None = None,  # [M, L] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The efficient kernel's state `(out [B, H, M, Dv], lse [B, H, M] float32)`; -inf where no key is seen."""
    bias = None if visible is None else _aligned_bias(visible, q.dtype).expand(*q.shape[:2], *visible.shape)
    out, lse, _, _ = _EFFICIENT(q, k, v, bias, True, 0.0, causal, scale=scale)
    lse = lse[..., : q.shape[-2]]
    if visible is not None:
        empty = ~visible.any(-1)  # [M]
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty[:, None], 0.0)
    return out, lse


def cuda_backward(
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
    """dL/dq, dL/dk, dL/dv of one key set on the efficient kernel, given the merged state."""
    bias = None if visible is None else _aligned_bias(visible, q.dtype).expand(*q.shape[:2], *visible.shape)
    m = q.shape[-2]
    padded = torch.zeros(
        (*lse.shape[:-1], -(-m // _LSE_ALIGN) * _LSE_ALIGN), dtype=torch.float32, device=lse.device
    )
    padded[..., :m] = lse
    unused = torch.empty((), dtype=torch.long)  # dropout's random state: no dropout
    d_q, d_k, d_v, _ = _EFFICIENT_BACKWARD(
        d_out.contiguous(), q, k, v, bias, out.contiguous(), padded, unused, unused, 0.0,
        [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return d_q, d_k, d_v


def cuda_kernel_ok(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the efficient kernel agrees with the reference on `device` for `dtype` and `head_dim`.

    Checked once per (device, dtype, head dim) on small cases (no mask, a window mask with rows that see no
    key, causal), forward and backward, at a tolerance of the dtype's precision; a failure or an error
    warns once and leaves the reference in use.
    """
    key = (str(device), dtype, int(head_dim))
    if key not in _PROBED:
        try:
            _PROBED[key] = _probe(device, dtype, head_dim)
            reason = "it disagreed with the reference"
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as err:
            _PROBED[key], reason = False, f"{type(err).__name__}: {err}"
        if not _PROBED[key]:
            warnings.warn(
                f"shared-past attention: torch's efficient SDPA kernel is not used on {device} for {dtype} "
                f"(head dim {head_dim}) because {reason}; the plain-PyTorch reference runs instead",
                stacklevel=2,
            )
    return _PROBED[key]


def _probe(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    scale = head_dim**-0.5
    m, n = 37, 45
    q, k, v, d_out = (
        torch.randn((1, 2, rows, head_dim), generator=gen).to(device, dtype) for rows in (m, n, n, m)
    )
    window = torch.arange(n)[None, :] > torch.arange(m)[:, None] - 8
    window[:3] = False  # rows that see no key of this set
    causal = torch.ones(m, m, dtype=torch.bool).tril()
    for is_causal, visible, ref_visible, length in (
        (False, None, None, n), (False, window, window, n), (True, None, causal, m)
    ):  # fmt: skip
        keys, values = k[:, :, :length], v[:, :, :length]
        vis = None if visible is None else visible.to(device)
        out, lse = cuda_state(q, keys, values, scale, causal=is_causal, visible=vis)
        mask = block_mask(None if ref_visible is None else ref_visible.to(device))
        qf, kf, vf = q[0].float(), keys[0].float(), values[0].float()
        r_out, r_lse = partial_state(qf, kf, vf, scale, mask)
        seen = torch.isfinite(r_lse)
        if not torch.equal(seen, torch.isfinite(lse[0])) or not _close(lse[0][seen], r_lse[seen], tol):
            return False
        if not _close(out[0], r_out, tol):
            return False
        # The backward runs with a merged state, as in use: here this set merged with one more (0, lse 0).
        merged_lse = torch.logaddexp(r_lse, torch.zeros_like(r_lse))  # [2, m]
        merged_out = r_out * torch.exp(r_lse - merged_lse)[..., None]
        dq, dk, dv = cuda_backward(
            q, keys, values, merged_out[None].to(dtype), merged_lse[None], d_out, scale,
            causal=is_causal, visible=vis,
        )  # fmt: skip
        r_dq = torch.zeros_like(qf)
        r_dk, r_dv = torch.zeros_like(kf), torch.zeros_like(vf)

        def sink(a: int, b: int, gk: torch.Tensor, gv: torch.Tensor, dk=r_dk, dv=r_dv) -> None:  # type: ignore[no-untyped-def]
            dk[:, a:b], dv[:, a:b] = gk, gv

        d_of = d_out[0].float()
        delta = (d_of * merged_out).sum(-1)
        partial_backward(qf, kf, vf, MergedGrad(merged_lse, d_of, delta), scale, mask, r_dq, sink)
        if not all(_close(x[0], y, tol) for x, y in ((dq, r_dq), (dk, r_dk), (dv, r_dv))):
            return False
    return True


def block_mask(visible: torch.Tensor | None) -> Mask:
    """The `Mask` of a `[M, L]` visibility (None: every key visible) for the block-by-block reference."""
    if visible is None:
        return lambda a, b: None
    return lambda a, b: visible[None, :, a:b]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    a, b = a.float(), b.float()
    return bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= tol * max(
        1.0, float(b.abs().max())
    )


def fused_state(
    q: torch.Tensor,  # [B, H, M, D]
    k: torch.Tensor,  # [B, H, L, D]
    v: torch.Tensor,  # [B, H, L, Dv]
    scale: float,
    *,
    causal: bool = False,
    visible: torch.Tensor | None = None,  # [M, L] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's state `(out [B, H, M, Dv], lse [B, H, M])`; -inf where a row sees no key."""
    dv = v.shape[-1]
    q, k, v = _same_head_size(q, k, v)
    if q.device.type == "cuda":
        out, lse = cuda_state(q, k, v, scale, causal=causal, visible=visible)
        return out[..., :dv], lse
    mask = None if visible is None else _additive(visible, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    if visible is not None:  # the kernel reports 0, not -inf, for a row without keys
        lse = lse.masked_fill(~visible.any(-1), float("-inf"))
    return out[..., :dv], lse


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
    d, dv = q.shape[-1], v.shape[-1]
    q, k, v = _same_head_size(q, k, v)
    out, d_out = _pad_head(out, v.shape[-1]), _pad_head(d_out, v.shape[-1])
    if q.device.type == "cuda":
        d_q, d_k, d_v = cuda_backward(q, k, v, out, lse, d_out, scale, causal=causal, visible=visible)
    else:
        mask = None if visible is None else _additive(visible, q.dtype)
        d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    return d_q[..., :d], d_k[..., :d], d_v[..., :dv]


def _pad_head(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def _same_head_size(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`q`, `k`, `v` zero-padded to one head size: the fused kernels need it, and MLA (DeepSeek V2/V3) has
    a value head smaller than its query/key head. Zero query/key columns add nothing to a score (the scale
    is passed explicitly), zero value columns give zero output columns, sliced off by the caller; so do
    their gradients."""
    size = max(q.shape[-1], v.shape[-1])
    return _pad_head(q, size), _pad_head(k, size), _pad_head(v, size)
