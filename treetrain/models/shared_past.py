"""Attention of K sibling rows against their common resident past, without materialising that past per row.

Why: the rows of a replay or scoring step share one past (their ancestors' resident KV, stored piece by
piece). Concatenating the pieces, broadcasting them to the K rows and expanding them to every query head
costs a copy of the whole past per row and per head, kept for backward; it set the engine's peak at long
context. Attention decomposes by key set instead. Each key set (one resident piece, or the rows' own
tokens) gives a partial output and the log-sum-exp of its scores, and partials merge exactly:

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

(the "attention state" merge of FlashInfer's cascade attention and Hydragen; it is associative). For a
piece, every row's and every query head's queries are stacked into one `[H_kv, K * group * T, D]` matrix
against the piece's single `[H_kv, P, D]` copy: one large matmul, no `repeat_kv`, no broadcast. The
backward is the flash-attention backward run per key set with the *merged* output and log-sum-exp, so a
piece's dL/dK and dL/dV come out once, already summed over rows and heads, and are added into its G
accumulator when one is given (through one transient piece-sized buffer per layer). Attention sinks
(gpt-oss) are one more logit per head with no value: one more state in the merge, `(0, sink)`. The key-set kernels
(`treetrain.models.attention_states`) are torch's fused flash-attention kernel on CPU, its memory-efficient
SDPA kernel on CUDA (after a probe on the device), and a block-by-block plain-PyTorch reference elsewhere;
none holds the scores of a whole key set.

Example:
    >>> import torch
    >>> from treetrain.models.shared_past import ScoreForm, shared_attention
    >>> q = torch.randn(2, 4, 3, 8, dtype=torch.float64)                 # [K, H, T, D]
    >>> own = torch.randn(2, 1, 3, 8, dtype=torch.float64)               # [K, H_kv, T, D]
    >>> piece = torch.randn(1, 1, 5, 8, dtype=torch.float64)             # [1, H_kv, P, D]
    >>> pos = torch.arange(5, 8)[None].expand(2, -1)                     # [K, T]
    >>> shared_attention(q, own, own, pos, ((piece, piece),), (None,), ScoreForm(8**-0.5)).shape
    torch.Size([2, 3, 4, 8])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treetrain.models.attention_states import (
    MergedGrad,
    block_mask,
    fused,
    fused_backward,
    fused_state,
    merge_into,
    merge_states,
    partial_backward,
    partial_state,
)
from treetrain.models.context_exchange import ContextExchange, merge_group
from treetrain.models.layer_entry import LayerEntry, LayerKV, kv_part, map_kv


@dataclass(frozen=True)
class SharedPast:
    """The resident past of a step's rows: per piece (root side first) per layer `(k, v)`, `[1, H_kv, P_i, D]`.

    `grads`, when given, holds per piece either None or G accumulators of the same shapes; backward adds each
    piece's dL/dK and dL/dV into them (summed over the rows) instead of returning them. Layers in
    `recurrent` hold `(conv state, recurrent state)` instead (`treetrain.models.recurrent_state`): no
    sequence axis, and only the last piece's is read. A layer with attention and a recurrent mixer holds a
    `HybridEntry`: attention reads its KV from every piece, the mixer its state from the last one.
    """

    pieces: tuple[tuple[LayerEntry, ...], ...]
    grads: tuple[tuple[LayerEntry, ...] | None, ...] = ()
    recurrent: frozenset[int] = frozenset()
    exchange: ContextExchange | None = None
    """With a context group, the pieces held on other ranks have KV on the `meta` device (shape only, no
    storage) and attention over them runs there (`treetrain.models.context_exchange`)."""

    @staticmethod
    def of(
        pieces: Sequence[Sequence[LayerEntry]],
        grads: Sequence[Sequence[LayerEntry] | None] | None = None,
        *,
        recurrent: frozenset[int] = frozenset(),
        exchange: ContextExchange | None = None,
    ) -> SharedPast:
        return SharedPast(
            tuple(tuple(p) for p in pieces),
            tuple(None if g is None else tuple(g) for g in grads) if grads is not None else (),
            recurrent,
            exchange,
        )

    @property
    def length(self) -> int:
        """Past positions: the sequence length of the first KV layer (0 when every layer is recurrent)."""
        first = (
            next((i for i in range(len(self.pieces[0])) if i not in self.recurrent), None)
            if self.pieces
            else None
        )
        return 0 if first is None else sum(int(kv_part(p[first])[0].shape[-2]) for p in self.pieces)

    def layer(self, index: int) -> tuple[tuple[LayerKV, ...], tuple[LayerKV | None, ...]]:
        """Layer `index`'s KV per piece and their G accumulators (a hybrid layer's KV part)."""
        kv = tuple(kv_part(p[index]) for p in self.pieces)
        grads = self.grads or (None,) * len(self.pieces)
        return kv, tuple(None if g is None else kv_part(g[index]) for g in grads)

    def held(self, index: int) -> tuple[tuple[LayerKV, ...], tuple[LayerKV | None, ...], tuple[int, ...]]:
        """Layer `index`'s non-empty pieces held on this rank, their G accumulators and first positions
        (pieces held elsewhere, on the `meta` device, are attended there)."""
        kv, grads = self.layer(index)
        starts, at = [], 0
        for k, _ in kv:
            starts.append(at)
            at += int(k.shape[-2])
        alone = self.exchange is None or not self.exchange.sharded
        if alone and any(k.is_meta for k, _ in kv):  # never drop a piece held elsewhere without its group
            raise RuntimeError("a past with pieces held on other ranks was read without their context group")
        keep = [i for i, (k, _) in enumerate(kv) if not k.is_meta and k.shape[-2] > 0]
        return tuple(kv[i] for i in keep), tuple(grads[i] for i in keep), tuple(starts[i] for i in keep)

    def without_last_position(self) -> SharedPast:
        """The same past minus its final position (the children recompute it as their overlap). Recurrent
        state (a hybrid's state part too) is already taken before that position, so it stays as it is."""
        if not self.pieces:
            return self

        def cut(p: Sequence[LayerEntry]) -> tuple[LayerEntry, ...]:
            return tuple(
                e if i in self.recurrent else map_kv(lambda t: t[:, :, :-1], e) for i, e in enumerate(p)
            )

        grads = list(self.grads)
        if grads and grads[-1] is not None:
            grads[-1] = cut(grads[-1])
        return SharedPast(
            (*self.pieces[:-1], cut(self.pieces[-1])), tuple(grads), self.recurrent, self.exchange
        )


@dataclass(frozen=True)
class _Spec:
    past: tuple[LayerKV, ...]
    grads: tuple[LayerKV | None, ...]
    positions: torch.Tensor  # [K, T]
    starts: tuple[int, ...]
    scale: float
    window: int | None
    softcap: float | None = None
    chunk: int | None = None
    exchange: ContextExchange | None = None

    @property
    def grouped(self) -> bool:
        """Whether other ranks hold pieces of this past (a sharded context group)."""
        return self.exchange is not None and self.exchange.sharded


Visible = torch.Tensor | None | str
"""Per piece: None (every key visible to every query), "none" (no key visible), or a `[M, P]` bool mask."""


def _lowest_key(spec: _Spec, qpos: torch.Tensor) -> torch.Tensor | None:
    """Each query's lowest visible key position (`[M]`), or None when every earlier key is visible. A window
    keeps keys > query - window; a chunk (Llama 4) keeps keys of the query's own chunk, at or after
    `(query // chunk) * chunk`: both are a lower bound on the key's absolute position."""
    low: torch.Tensor | None = None
    if spec.window is not None:
        low = qpos - spec.window + 1
    if spec.chunk is not None:
        start = torch.div(qpos, spec.chunk, rounding_mode="floor") * spec.chunk
        low = start if low is None else torch.maximum(low, start)
    return low


def _bounds(low: torch.Tensor | None) -> tuple[int, int]:
    """The lowest and highest lower bound, read once per call (on CUDA each read synchronises)."""
    return (0, 0) if low is None else (int(low.min()), int(low.max()))


def _piece_visible(low: torch.Tensor | None, bounds: tuple[int, int], start: int, length: int) -> Visible:
    """Past keys precede every query; of those, a query sees the keys at or above its lowest (`_lowest_key`)."""
    if length == 0:  # a one-token last piece without its overlap position
        return "none"
    if low is None:
        return None
    lo, hi = bounds
    if start >= hi:
        return None
    if start + length - 1 < lo:
        return "none"
    kpos = torch.arange(start, start + length, device=low.device)
    return kpos[None, :] >= low[:, None]  # [M, P]


def _own_visible(spec: _Spec, t: int, device: torch.device) -> torch.Tensor:
    """The rows' own keys each own query sees, `[T, T]`: causal, within the window and the chunk. The rows
    continue one past, so they share positions (a chunk's bounds are absolute)."""
    i = torch.arange(t, device=device)
    keep = i[None, :] <= i[:, None]
    if spec.window is not None:
        keep = keep & (i[:, None] - i[None, :] < spec.window)
    if spec.chunk is not None:
        pos = spec.positions[0].to(device)
        if spec.positions.shape[0] > 1 and not bool((spec.positions == pos[None]).all()):
            raise ValueError("chunked attention over a shared past needs rows at the same positions")
        chunk = torch.div(pos, spec.chunk, rounding_mode="floor")
        keep = keep & (chunk[None, :] == chunk[:, None])
    return keep  # [T, T]


def _local(spec: _Spec) -> bool:
    """Whether a window or chunk restricts the keys beyond causality."""
    return spec.window is not None or spec.chunk is not None


class _Layout:
    """Index maps between the per-row layout `[K, H, T, .]` and the stacked one `[H_kv, K * group * T, .]`."""

    def __init__(self, q: torch.Tensor, kv_heads: int) -> None:
        self.rows, self.heads, self.t, self.d = q.shape
        self.kv_heads, self.group = kv_heads, self.heads // kv_heads
        self.m = self.rows * self.group * self.t

    def stacked(self, x: torch.Tensor) -> torch.Tensor:  # [K, H, T, X] -> [H_kv, M, X]
        return (
            x.reshape(self.rows, self.kv_heads, self.group, self.t, -1)
            .transpose(0, 1)
            .reshape(self.kv_heads, self.m, -1)
        )

    def per_row(self, x: torch.Tensor) -> torch.Tensor:  # [H_kv, M, X] -> [K, H, T, X]
        return (
            x.reshape(self.kv_heads, self.rows, self.group, self.t, -1)
            .transpose(0, 1)
            .reshape(self.rows, self.heads, self.t, -1)
        )


def _sink_logits(sinks: torch.Tensor, lay: _Layout, dtype: torch.dtype) -> torch.Tensor:
    """Per-head sink logits `[H]` in the stacked layout `[H_kv, M]` (head = kv head * group + g)."""
    per = sinks.to(dtype).reshape(lay.kv_heads, 1, lay.group, 1)
    return per.expand(lay.kv_heads, lay.rows, lay.group, lay.t).reshape(lay.kv_heads, lay.m)


class _SharedAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k_own: torch.Tensor,
        v_own: torch.Tensor,
        sinks: torch.Tensor | None,
        spec: _Spec,
        *past: torch.Tensor,
    ) -> torch.Tensor:
        lay = _Layout(q, k_own.shape[1])
        stat = torch.promote_types(q.dtype, torch.float32)
        # Stacked queries: every row's and every head of a group's queries against one copy of the past.
        qs = lay.stacked(q)  # [H_kv, M, D]
        qpos = spec.positions[:, None, :].expand(lay.rows, lay.group, lay.t).reshape(-1)  # [M]
        low = _lowest_key(spec, qpos)
        bounds = _bounds(low)
        own_vis = _own_visible(spec, lay.t, q.device) if _local(spec) else None
        use_fused = fused(q) and spec.softcap is None  # the fused kernels take no score modification
        if use_fused:  # the rows' own keys are T-sized: expanding them to the query heads is cheap
            ke, ve = k_own.repeat_interleave(lay.group, 1), v_own.repeat_interleave(lay.group, 1)
            o, ls = fused_state(q, ke, ve, spec.scale, causal=own_vis is None, visible=own_vis)
            out, lse = lay.stacked(o).to(stat), lay.stacked(ls[..., None])[..., 0].to(stat)
        else:
            o, ls = partial_state(
                q.reshape(lay.rows * lay.kv_heads, lay.group * lay.t, lay.d),
                k_own.reshape(lay.rows * lay.kv_heads, lay.t, -1), v_own.reshape(lay.rows * lay.kv_heads, lay.t, -1),
                spec.scale, block_mask(_own_visible(spec, lay.t, q.device).repeat(lay.group, 1)),
                spec.softcap,
            )  # fmt: skip
            out = lay.stacked(o.reshape(lay.rows, lay.heads, lay.t, -1))
            lse = lay.stacked(ls.reshape(lay.rows, lay.heads, lay.t, 1))[..., 0]
        held: tuple[torch.Tensor, torch.Tensor] | None = None  # a group's state over this rank's pieces
        for (k, v), start in zip(spec.past, spec.starts):
            vis = _piece_visible(low, bounds, start, k.shape[-2])
            if isinstance(vis, str):
                continue
            if use_fused:
                po, pl = fused_state(qs[None], k, v, spec.scale, visible=vis)
                po, pl = po[0].to(stat), pl[0].to(stat)
            else:
                po, pl = partial_state(qs, k[0], v[0], spec.scale, block_mask(vis), spec.softcap)
            if spec.grouped:
                held = (po, pl) if held is None else merge_states(*held, po, pl)
            else:  # the running state has seen each row's own token, so its lse is finite: merge in place
                out, lse = merge_into(out, lse, po, pl)
        if spec.grouped:
            assert spec.exchange is not None
            out, lse = merge_group(spec.exchange, out, lse, held)
        if sinks is not None:  # a sink is one more logit with a zero value: it only enlarges the denominator
            total = torch.logaddexp(lse, _sink_logits(sinks, lay, stat))
            out, lse = out * torch.exp(lse - total)[..., None], total
        ctx.spec, ctx.lay, ctx.fused = spec, lay, use_fused
        ctx.save_for_backward(q, k_own, v_own, sinks, out, lse, *past)
        # [H_kv, M, Dv] -> [K, T, H, Dv]
        return lay.per_row(out).transpose(1, 2).contiguous().to(q.dtype)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # d_out [K, T, H, Dv]
        q, k_own, v_own, sinks, out, lse, *past = ctx.saved_tensors
        spec: _Spec = ctx.spec
        lay: _Layout = ctx.lay
        do = lay.stacked(d_out.transpose(1, 2))  # [H_kv, M, Dv]
        qs = lay.stacked(q)
        qpos = spec.positions[:, None, :].expand(lay.rows, lay.group, lay.t).reshape(-1)
        low = _lowest_key(spec, qpos)
        bounds = _bounds(low)
        d_qs = torch.zeros_like(qs)
        delta = (do.to(lse.dtype) * out).sum(-1)  # [H_kv, M]
        do_past, delta_past = do, delta  # a group's pieces take the group's summed output gradient
        if spec.grouped:
            assert spec.exchange is not None
            do_past = spec.exchange.all_reduce(do)
            delta_past = (do_past.to(lse.dtype) * out).sum(-1)
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:  # dL/d(sink) = -p(sink) * delta, summed per head
            p_sink = torch.exp(_sink_logits(sinks, lay, lse.dtype) - lse)
            d_sinks = (-(p_sink * delta)).reshape(lay.kv_heads, lay.rows, lay.group, lay.t).sum((1, 3))
            d_sinks = d_sinks.reshape(-1).to(sinks.dtype)
        out_q = out.to(q.dtype)
        piece_grads: list[torch.Tensor | None] = []
        for i, (start, acc) in enumerate(zip(spec.starts, spec.grads)):
            k, v = past[2 * i], past[2 * i + 1]
            wanted = acc is None and (ctx.needs_input_grad[5 + 2 * i] or ctx.needs_input_grad[6 + 2 * i])
            vis = _piece_visible(low, bounds, start, k.shape[-2])
            if isinstance(vis, str):
                piece_grads += [torch.zeros_like(k), torch.zeros_like(v)] if wanted else [None, None]
                continue
            if ctx.fused:
                dq, dk, dv = fused_backward(
                    qs[None], k, v, out_q[None], lse[None], do_past[None], spec.scale, visible=vis
                )
                d_qs.add_(dq[0])
            else:
                dk, dv = torch.zeros_like(k), torch.zeros_like(v)

                def sink(a: int, b: int, gk: torch.Tensor, gv: torch.Tensor, dk=dk, dv=dv) -> None:  # type: ignore[no-untyped-def]
                    dk[0, :, a:b] = gk
                    dv[0, :, a:b] = gv

                merged = MergedGrad(lse, do_past, delta_past)
                partial_backward(
                    qs, k[0], v[0], merged, spec.scale, block_mask(vis), d_qs, sink, spec.softcap
                )
            if acc is not None:
                acc[0].add_(dk)
                acc[1].add_(dv)
            piece_grads += [dk, dv] if wanted else [None, None]
        own_vis = _own_visible(spec, lay.t, q.device) if _local(spec) else None
        if ctx.fused:
            ke, ve = k_own.repeat_interleave(lay.group, 1), v_own.repeat_interleave(lay.group, 1)
            d_q, dke, dve = fused_backward(
                q, ke, ve, lay.per_row(out_q), lay.per_row(lse[..., None])[..., 0], lay.per_row(do), spec.scale,
                causal=own_vis is None, visible=own_vis,
            )  # fmt: skip
            shape = (lay.rows, lay.kv_heads, lay.group, lay.t, -1)
            d_k, d_v = dke.reshape(shape).sum(2), dve.reshape(shape).sum(2)
        else:
            n, g = lay.rows * lay.kv_heads, lay.group * lay.t
            d_qo = torch.zeros(n, g, lay.d, dtype=q.dtype, device=q.device)
            d_k, d_v = (
                torch.zeros_like(k_own).reshape(n, lay.t, -1),
                torch.zeros_like(v_own).reshape(n, lay.t, -1),
            )

            def own_sink(a: int, b: int, gk: torch.Tensor, gv: torch.Tensor) -> None:
                d_k[:, a:b] = gk
                d_v[:, a:b] = gv

            def own(x: torch.Tensor) -> torch.Tensor:
                return lay.per_row(x).reshape(n, g, -1)

            partial_backward(
                q.reshape(n, g, lay.d), k_own.reshape(n, lay.t, -1), v_own.reshape(n, lay.t, -1),
                MergedGrad(own(lse[..., None])[..., 0], own(do), own(delta[..., None])[..., 0]), spec.scale,
                block_mask(_own_visible(spec, lay.t, q.device).repeat(lay.group, 1)), d_qo, own_sink,
                spec.softcap,
            )  # fmt: skip
            d_q = d_qo.reshape(lay.rows, lay.heads, lay.t, lay.d)
        d_q = d_q + lay.per_row(d_qs)
        return (d_q, d_k.reshape(k_own.shape), d_v.reshape(v_own.shape), d_sinks, None, *piece_grads)


@dataclass(frozen=True)
class HeldPieces:
    """Where the pieces passed to `shared_attention` sit, and who holds the others."""

    starts: tuple[int, ...]  # each piece's first position
    exchange: ContextExchange | None = None
    """The context group whose other ranks hold the rest of the past (None: the pieces are all of it)."""


@dataclass(frozen=True)
class ScoreForm:
    """How a layer turns query-key products into attention scores, as its module's forward says."""

    scale: float
    """Multiplies every query-key product."""
    window: int | None = None
    """Sliding window: a query sees keys with position > its own - window (None: every earlier key)."""
    softcap: float | None = None
    """Gemma 2's soft-capping of the scaled scores, `cap * tanh(s / cap)` (None: uncapped)."""
    chunk: int | None = None
    """Chunked attention (Llama 4's `attention_chunk_size`): a query at absolute position i sees keys j <= i
    with j // chunk == i // chunk (None: no chunks)."""


def shared_attention(
    q: torch.Tensor,  # [K, H, T, D]
    k_own: torch.Tensor,  # [K, H_kv, T, D]
    v_own: torch.Tensor,  # [K, H_kv, T, Dv]
    positions: torch.Tensor,  # [K, T]
    past: Sequence[LayerKV],  # per piece [1, H_kv, P_i, D], positions 0.. in order
    grads: Sequence[LayerKV | None],
    form: ScoreForm,
    *,
    sinks: torch.Tensor | None = None,  # [H]
    held: HeldPieces | None = None,
) -> torch.Tensor:
    """Causal attention of the rows' queries over the shared past and their own tokens: `[K, T, H, Dv]`.

    Past keys sit at positions `0..P-1` and every query comes after them; `form.window` keeps keys with
    position > query position - window (Hugging Face's sliding window), and `form.chunk` those of the
    query's own chunk, key // chunk == query // chunk (Llama 4). The rows' own tokens are consecutive, so a
    query at own index i sees own keys j <= i (and i - j < window, in its chunk). `sinks` (gpt-oss) are
    per-head logits in every softmax's denominator with no value; they get their gradient. `form.softcap`
    (Gemma 2) caps every scaled score, `cap * tanh(s / cap)`; the fused kernels take no score modification,
    so a capped layer runs the block-by-block reference for every key set.

    `held` says where the pieces sit (consecutive from position 0 if omitted) and, with a sharded context
    group, that `past` is this rank's share of them: the other ranks of the group attend the rest in the
    same call (`treetrain.models.context_exchange`), and the output is the whole past's on every rank.
    """
    starts: Sequence[int] = () if held is None else held.starts
    if held is None:
        at, starts = 0, []
        for k, _ in past:
            starts.append(at)
            at += int(k.shape[-2])
    exchange = None if held is None else held.exchange
    spec = _Spec(
        tuple(past), tuple(grads) or (None,) * len(past), positions, tuple(starts), form.scale, form.window,
        form.softcap, form.chunk, exchange,
    )  # fmt: skip
    flat = [t for kv in past for t in kv]
    out: torch.Tensor = _SharedAttention.apply(q, k_own, v_own, sinks, spec, *flat)
    return out
