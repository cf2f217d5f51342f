"""The recurrent layer kinds whose state the engine keeps resident, and how each one's own code is captured.

A kind names the functions a layer's module calls for its sequence and its single-step forms (the layer
looks them up in its module by name), the attributes that size its state, and a captured version of each
function. While a capture is active (`CAPTURE`), the captured function makes the positions from each row's
cut on leave the state as it is, so the sequence form ends at the state *before* the row's last real
token, and computes that token's output with one step from it (`treetrain.models.recurrent_state`).

- **Gated DeltaNet** (Qwen3.5, Qwen3-Next, OLMo hybrid, Lara mini): `g = 0` and `beta = 0` neither decay
  nor update the delta rule's state; its kernel takes an initial state.
- **Kimi delta attention** (Kimi Linear, Bailing hybrid): the same delta rule with a log gate per key
  channel (`g` is `[B, T, H, D_k]`), so the same `g = 0` and `beta = 0`; q, k and v share one short
  convolution, whose window is one conv state.
- **Mamba** (Mamba, Falcon-Mamba, Jamba, Zamba): `dt = 0` gives `exp(dt A) = 1` and `dt B x = 0`. The
  selective scan takes no initial state, so the initial state's part is added in closed form: the state is
  linear in it, `h_t = exp(A * sum(dt_1..t)) h_0 + (the scan from zero)`, and so is the output `C_t h_t`.
  Zamba's mixer splits its channels into heads and scans each head on its own, in head order, keeping a
  `[B, H, I / H, N]` state: each scan continues its own head's slice of it (`StateSource.next_head`).
- **WKV** (RWKV): the recurrence is a loop over positions in plain torch, so the captured form runs the
  same loop op for op and keeps, per row, the state after the token before its cut (the one the row's
  last token starts from); outputs are the model's own. Its state reaches the layer through the model's
  `state` argument, not a cache (`treetrain.models.rwkv_state`).

Example:
    >>> sorted(k.name for k in KINDS)
    ['gated_deltanet', 'kimi_delta', 'mamba', 'mamba2', 'wkv']
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class StateSource(Protocol):
    """Where a captured function finds the initial state of the layer now running (the engine's cache)."""

    def current_state(self) -> torch.Tensor | None: ...

    def next_head(self) -> int:
        """The head the layer now running scans next (its scans over heads come in head order)."""
        ...


@dataclass
class Capture:
    cut: torch.Tensor  # [B] index of each row's last real token: the state is taken before it
    source: StateSource


CAPTURE: ContextVar[Capture | None] = ContextVar("treetrain_recurrent_capture", default=None)


def _active() -> Capture:
    active = CAPTURE.get()
    if active is None:
        raise RuntimeError("a captured recurrent function ran outside a recurrent-state capture")
    return active


@dataclass(frozen=True)
class Kind:
    """One kind of recurrent layer."""

    name: str
    functions: tuple[str, str]
    """The sequence form and the single-step form, as the layer's module names them."""
    sizes: tuple[str, ...]
    """Integer attributes of the layer that size its state."""
    state_bytes: Callable[[Any, int], int]
    """Bytes of one layer's (conv state, recurrent state), given the layer and the model's element size."""
    captured: Callable[[Callable[..., Any], Callable[..., Any]], Callable[..., Any]]
    """(original sequence form, original step form) -> the captured sequence form."""
    captured_step: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    """original step form -> the captured step form (None: the step form is only ever called by the
    captured sequence form)."""

    def matches(self, module: nn.Module) -> bool:
        mod = sys.modules.get(type(module).__module__)
        return (
            mod is not None
            and all(callable(getattr(mod, f, None)) for f in self.functions)
            and all(isinstance(getattr(module, f, None), int) for f in self.sizes)
        )


def _delta_rule(chunk: Callable[..., Any], step: Callable[..., Any]) -> Callable[..., Any]:
    def rule(
        query: torch.Tensor,  # [B, T, H_k, D_k]
        key: torch.Tensor,  # [B, T, H_k, D_k]
        value: torch.Tensor,  # [B, T, H_v, D_v]
        g: torch.Tensor,  # [B, T, H_v] (Gated DeltaNet) or [B, T, H, D_k] (KDA: a log gate per key channel)
        beta: torch.Tensor,  # [B, T, H_v]
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cut = _active().cut
        kwargs.pop("chunk_size", None)
        t = torch.arange(query.shape[1], device=query.device)
        before = (t[None, :] < cut[:, None]).to(g.dtype)  # [B, T]
        gate = g * before.view(*before.shape, *[1] * (g.dim() - 2))  # g's shape, 0 from the cut on
        out, state = chunk(
            query, key, value, g=gate, beta=beta * before.to(beta.dtype)[..., None], initial_state=initial_state,
            output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs,
        )  # fmt: skip
        rows = torch.arange(query.shape[0], device=query.device)
        last, _ = step(
            query[rows, cut][:, None], key[rows, cut][:, None], value[rows, cut][:, None],
            g=g[rows, cut][:, None], beta=beta[rows, cut][:, None], initial_state=state,
            output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs,
        )  # fmt: skip  # [B, 1, H_v, D_v]
        return out.index_put((rows, cut), last[:, 0].to(out.dtype)), state

    return rule


def _delta_rule_step(step: Callable[..., Any]) -> Callable[..., Any]:
    def single(
        *args: Any, **kwargs: Any
    ) -> Any:  # a one-token forward: cut 0, the state stays the initial one
        out, _ = step(*args, **{**kwargs, "output_final_state": False})
        return out, kwargs.get("initial_state")

    return single


def _delta_rule_bytes(layer: Any, size: int) -> int:
    conv = (int(layer.key_dim) * 2 + int(layer.value_dim)) * (int(layer.conv_kernel_size) - 1) * size
    return conv + int(layer.num_v_heads) * int(layer.head_k_dim) * int(layer.head_v_dim) * 4  # float32 state


def _kimi_delta_bytes(layer: Any, size: int) -> int:
    conv = int(layer.conv_dim) * (int(layer.conv_kernel_size) - 1) * size  # q, k and v in one window
    return conv + int(layer.num_heads) * int(layer.head_dim) ** 2 * 4  # float32 state [H, D_k, D_v]


def _selective_scan(scan: Callable[..., Any], step: Callable[..., Any]) -> Callable[..., Any]:
    def captured(
        hidden_states: torch.Tensor,  # [B, I, T]
        dt: torch.Tensor,  # [B, I, T]
        A: torch.Tensor,  # [I, N]
        B: torch.Tensor,  # [B, N, T]
        C: torch.Tensor,  # [B, N, T]
        D: torch.Tensor | None = None,
        z: torch.Tensor | None = None,  # [B, I, T]
        delta_bias: torch.Tensor | None = None,
        delta_softplus: bool = False,
        return_last_state: bool = False,
        **kwargs: Any,
    ) -> Any:
        active = _active()
        cut = active.cut
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        t = torch.arange(dt.shape[-1], device=dt.device)
        dt_in = dt * (t[None, :] < cut[:, None]).to(dt.dtype)[:, None, :]  # [B, I, T]
        out, state = scan(hidden_states, dt_in, A, B, C, D=D, z=z, return_last_state=True, **kwargs)
        h0 = active.source.current_state()  # [B, I, N], or per head [B, H, I, N] (Zamba), or None at the root
        if h0 is not None and h0.dim() == 4:
            h0 = h0[:, active.source.next_head()]  # [B, I, N]
        if h0 is not None:
            cum = dt_in.cumsum(-1)  # [B, I, T]
            decay = torch.exp(A[None, :, None, :] * cum[..., None])  # [B, I, T, N]
            part = (decay * h0[:, :, None, :] * C.transpose(1, 2)[:, None, :, :]).sum(-1)  # [B, I, T]
            if z is not None:
                part = part * F.silu(z)
            out = out + part.to(out.dtype)
            state = state + (torch.exp(A[None] * cum[..., -1:]) * h0).to(state.dtype)
        rows = torch.arange(dt.shape[0], device=dt.device)
        last = _mamba_step(
            state, hidden_states[rows, :, cut], dt[rows, :, cut], A, B[rows, :, cut], C[rows, :, cut], D,
            z=None if z is None else z[rows, :, cut],
        )  # fmt: skip  # [B, I]
        at_cut = (t[None, :] == cut[:, None])[:, None, :]  # [B, 1, T]
        out = torch.where(at_cut, last[..., None].to(out.dtype), out)
        return (out, state) if return_last_state else out

    return captured


def _mamba_step(
    state: torch.Tensor,  # [B, I, N]
    hidden_states: torch.Tensor,  # [B, I]
    dt: torch.Tensor,  # [B, I]
    A: torch.Tensor,  # [I, N]
    B: torch.Tensor,  # [B, N]
    C: torch.Tensor,  # [B, N]
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    z: torch.Tensor | None = None,  # [B, I]
    **kwargs: Any,
) -> torch.Tensor:
    """One Mamba step, as transformers' `mamba_selective_state_update` computes it, without its in-place
    write into `state` (which, in float32, overwrites a tensor its own backward needs)."""
    dtype = hidden_states.dtype
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    d_a = torch.exp(dt.float()[..., None] * A.float())  # [B, I, N]
    d_bx = dt.float()[..., None] * B.float()[:, None, :] * hidden_states.float()[..., None]
    h = state.float() * d_a + d_bx
    out = torch.matmul(h.to(C.dtype), C.unsqueeze(-1)).squeeze(-1)  # [B, I]
    if D is not None:
        out = out + hidden_states * D
    if z is not None:
        out = out * F.silu(z)
    return out.to(dtype)


def _selective_step(step: Callable[..., Any]) -> Callable[..., Any]:
    return _mamba_step  # a one-token forward from a resident state: the state stays the initial one


def _mamba_bytes(layer: Any, size: int) -> int:
    """The conv window in the model's dtype; the selective-scan state in float32 or wider (the scan runs in
    float32 below it)."""
    inner = int(layer.intermediate_size)
    return inner * (int(layer.conv_kernel_size) - 1) * size + inner * int(layer.ssm_state_size) * max(size, 4)


def _chunk_scan(scan: Callable[..., Any], step: Callable[..., Any]) -> Callable[..., Any]:
    def captured(
        hidden_states: torch.Tensor,  # [B, T, H, P]
        dt: torch.Tensor,  # [B, T, H]
        A: torch.Tensor,  # [H]
        B: torch.Tensor,  # [B, T, G, N]
        C: torch.Tensor,  # [B, T, G, N]
        chunk_size: int,
        D: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        initial_states: torch.Tensor | None = None,  # [B, H, P, N]
        dt_softplus: bool = False,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        return_final_states: bool = False,
        **kwargs: Any,
    ) -> Any:
        cut = _active().cut
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        t = torch.arange(dt.shape[1], device=dt.device)
        dt_in = dt * (t[None, :] < cut[:, None]).to(dt.dtype)[..., None]  # [B, T, H]
        out, state = scan(
            hidden_states, dt_in, A, B, C, chunk_size, D=D, initial_states=initial_states,
            return_final_states=True, **kwargs,
        )  # fmt: skip  # [B, T, H, P], [B, H, P, N]
        rows = torch.arange(dt.shape[0], device=dt.device)
        last = _mamba2_step(
            state, hidden_states[rows, cut], dt[rows, cut][..., None].expand(-1, -1, hidden_states.shape[-1]),
            A[:, None, None].expand(-1, hidden_states.shape[-1], B.shape[-1]), B[rows, cut], C[rows, cut],
            None if D is None else D[:, None].expand(-1, hidden_states.shape[-1]),
        )  # fmt: skip  # [B, H, P]
        out = out.index_put((rows, cut), last.to(out.dtype))
        return (out, state) if return_final_states else out

    return captured


def _mamba2_step(
    state: torch.Tensor,  # [B, H, P, N]
    hidden_states: torch.Tensor,  # [B, H, P]
    dt: torch.Tensor,  # [B, H, P]
    A: torch.Tensor,  # [H, P, N]
    B: torch.Tensor,  # [B, G, N]
    C: torch.Tensor,  # [B, G, N]
    D: torch.Tensor | None = None,  # [H, P]
    dt_bias: torch.Tensor | None = None,  # [H, P]
    dt_softplus: bool = False,
    z: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """One Mamba-2 step, as transformers' `mamba2_selective_state_update` computes it, without its
    in-place write into `state` (which overwrites a tensor its own backward needs)."""
    heads, groups = hidden_states.shape[1], B.shape[1]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    d_a = torch.exp(dt[..., None].float() * A.float())  # [B, H, P, N]
    b_h = B.repeat_interleave(heads // groups, dim=1)[:, :, None, :]  # [B, H, 1, N]
    c_h = C.repeat_interleave(heads // groups, dim=1)  # [B, H, N]
    h = state * d_a + dt[..., None] * b_h * hidden_states[..., None]
    out = torch.matmul(h.to(c_h.dtype), c_h[..., None]).squeeze(-1)  # [B, H, P]
    if D is not None:
        out = (out + hidden_states * D).to(out.dtype)
    if z is not None:
        out = out * F.silu(z)
    return out.to(hidden_states.dtype)


def _chunk_step(step: Callable[..., Any]) -> Callable[..., Any]:
    return _mamba2_step  # a one-token forward from a resident state: the state stays the initial one


def _mamba2_bytes(layer: Any, size: int) -> int:
    conv = int(layer.conv_dim) * (int(layer.conv_kernel_size) - 1) * size
    return conv + int(layer.num_heads) * int(layer.head_dim) * int(layer.ssm_state_size) * 4  # float32 state


def _wkv(sequence: Callable[..., Any], step: Callable[..., Any]) -> Callable[..., Any]:
    def captured(
        time_decay: torch.Tensor,  # [A]
        time_first: torch.Tensor,  # [A]
        key: torch.Tensor,  # [B, T, A]
        value: torch.Tensor,  # [B, T, A]
        state: tuple[torch.Tensor, ...] | None = None,  # (numerator, denominator, max), each [B, A]
        return_state: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`rwkv_linear_attention_cpu`'s recurrence, op for op, returning the state before each row's cut
        instead of after the last position. The initial state is cloned: the model writes each layer's
        result into the tensors it sliced that state from, which would change a tensor this graph saved."""
        cut = _active().cut
        output = torch.zeros_like(key)
        if state is None:
            num = torch.zeros_like(key[:, 0], dtype=torch.float32)
            den = torch.zeros_like(key[:, 0], dtype=torch.float32)
            mx = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38
        else:
            num, den, mx = (s.clone() for s in state)
        decay = -torch.exp(time_decay)
        saved = [num, den, mx]  # a row cut at 0 keeps its initial state
        for t in range(key.shape[1]):
            k = key[:, t].float()
            v = value[:, t]
            out_max = torch.maximum(mx, k + time_first)
            e1 = torch.exp(mx - out_max)
            e2 = torch.exp(k + time_first - out_max)
            output[:, t] = ((e1 * num + e2 * v) / (e1 * den + e2)).to(output.dtype)
            state_max = torch.maximum(mx + decay, k)
            e1 = torch.exp(mx + decay - state_max)
            e2 = torch.exp(k - state_max)
            num, den, mx = e1 * num + e2 * v, e1 * den + e2, state_max
            at = (cut == t + 1)[:, None]  # [B, 1]: the state after token t is the one before token t + 1
            saved = [torch.where(at, new, old) for new, old in zip((num, den, mx), saved, strict=True)]
        return output, saved

    return captured


def _wkv_bytes(layer: Any, size: int) -> int:
    shifts = 2 * int(layer.config.hidden_size) * size  # the attention's and the feed-forward's last input
    return shifts + 3 * int(layer.attention_hidden_size) * 4  # float32 (numerator, denominator, max)


GATED_DELTANET = Kind(
    "gated_deltanet",
    ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    ("conv_kernel_size", "key_dim", "value_dim", "num_v_heads", "head_k_dim", "head_v_dim"),
    _delta_rule_bytes,
    _delta_rule,
    _delta_rule_step,
)
KIMI_DELTA = Kind(
    "kimi_delta",
    ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
    ("conv_kernel_size", "conv_dim", "num_heads", "head_dim"),
    _kimi_delta_bytes,
    _delta_rule,
    _delta_rule_step,
)
MAMBA = Kind(
    "mamba",
    ("mamba_selective_scan", "mamba_selective_state_update"),
    ("conv_kernel_size", "intermediate_size", "ssm_state_size"),
    _mamba_bytes,
    _selective_scan,
    _selective_step,
)
MAMBA2 = Kind(
    "mamba2",
    ("mamba2_chunk_scan", "mamba2_selective_state_update"),
    ("conv_kernel_size", "conv_dim", "num_heads", "head_dim", "ssm_state_size"),
    _mamba2_bytes,
    _chunk_scan,
    _chunk_step,
)
WKV = Kind(
    "wkv",
    ("rwkv_linear_attention", "rwkv_linear_attention_cpu"),
    ("attention_hidden_size", "layer_id"),
    _wkv_bytes,
    _wkv,
)
KINDS = (GATED_DELTANET, KIMI_DELTA, MAMBA, MAMBA2, WKV)


#: Recurrent mixers of no kind, by class name, and what each lacks that a kind needs (the refusal says it).
NO_KIND: dict[str, str] = {
    "MiniMaxLightningAttention": (
        "it runs its recurrence inline in its forward, with no sequence or step function to stop at a row's "
        "cut, and keeps its state in MiniMaxCache's linear cache (MiniMaxModel takes no other cache)"
    ),
}


def kind_of(module: nn.Module) -> Kind | None:
    return next((k for k in KINDS if k.matches(module)), None)
