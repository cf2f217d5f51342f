"""A context several rows continue is read once: the `hf` engine's attention over pieces of shared KV.

Why: decoding a small model on a CPU is bound by the bytes of KV each step reads, not by arithmetic. The
`n` rows sampled from one context each held a copy of its KV and read it at every step; joining and
compacting the padded batch copied it again. Here a context that `n > 1` rows continue is a `Piece`, held
once, and each row's own tokens (its turn, and for a continuation the tool result before it) are the padded
per-row cache. Attention decomposes by key set (`treetrain.models.attention_states`): the rows' own keys in
one call under a per-row mask, then each piece once for all the rows that share it, their queries stacked
(`[H_kv, rows * group * T, D]` against one `[H_kv, P, D]` copy), merged exactly by log-sum-exp.

Only layers whose attention is plain scaled dot-product attention over the cache's keys take this path
(`cascade_reason`); a model with anything else (soft-capping, sinks, position biases, latents expanded by
the layer, a mask of its own) keeps every row's full KV, and `CascadeError` names what it passed.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    >>> cascade_reason(model) is None
    True
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from treetrain.models.attention import shared_past_kernel_note, shared_past_reason
from treetrain.models.attention_states import fused_state, merge_into
from treetrain.models.module_modes import evaluating
from treetrain.models.recurrent_state import recurrent_layers
from treetrain.rollout.engines.batch_cache import new_cache

NAME = "treetrain_cascade"
#: Attention arguments this path does not model: a layer that passes one keeps the plain path.
UNMODELLED = ("softcap", "s_aux", "sinks", "position_bias", "sliding_window")


class CascadeError(RuntimeError):
    """A layer asked its attention for something the piece-by-piece path does not reproduce."""


@dataclass(frozen=True, eq=False)
class Piece:
    """KV of consecutive positions that several rows continue: per layer `(k, v)`, `[1, H_kv, P, D]`."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[-2]) if self.layers else 0

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of the piece's storage (its tensors are its own: copies, never views of a batch)."""
        return sum(t.untyped_storage().nbytes() for kv in self.layers for t in kv)


Chain = tuple[Piece, ...]
"""The pieces a row attends over before its own tokens, root side first."""


def chain_length(chain: Chain) -> int:
    return sum(p.length for p in chain)


def chain_key(chain: Chain) -> tuple[int, ...]:
    """A sort key that puts rows sharing pieces side by side (`groups_of`)."""
    return tuple(id(p) for p in chain)


@dataclass(frozen=True)
class Layout:
    """What a forward's attention reads besides the layer's arguments."""

    groups: tuple[tuple[int, int, Piece], ...]
    """Runs of consecutive rows `[start, stop)` and a piece they all attend over (`groups_of`)."""
    visible: torch.Tensor  # [R, T, W] bool
    """Which of the rows' own cache columns each query sees (padding and later tokens hidden)."""
    _masks: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def masks(self, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`visible` for `group` query heads per key head, `[R, 1, group * T, W]`, and as an additive bias
        of `dtype`: built once per forward, read by every layer."""
        key = (group, dtype)
        if key not in self._masks:
            visible = self.visible[:, None].repeat(1, 1, group, 1)
            bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[key] = (visible, bias.masked_fill_(~visible, float("-inf")))
        return self._masks[key]


_ACTIVE: ContextVar[Layout | None] = ContextVar("treetrain_cascade", default=None)


def cascade_reason(model: PreTrainedModel) -> str | None:
    """None when `model`'s attention layers can read shared pieces; otherwise why not."""
    reason = shared_past_reason(model)
    if reason is not None:
        return reason
    if recurrent_layers(model):
        return "it has recurrent layers"
    note = shared_past_kernel_note(model)
    if note is not None:
        return note
    if any(callable(getattr(m, "expand_kv", None)) for m in model.modules()):
        return "its cache holds latents its attention expands"
    return None


@torch.no_grad()
def cascade_runs(model: PreTrainedModel) -> bool:
    """Whether `model`'s layers run under cascade attention and agree with their own attention on a short
    input (a probe: a layer may pass its attention what `cascade_reason` cannot see)."""
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3]], device=device)  # [1, 3]
    visible = torch.ones(3, 3, dtype=torch.bool, device=device).tril()[None]  # [1, 3, 3]
    try:
        with evaluating(model):  # as the engine samples: no dropout
            with cascade(model, Layout((), visible)):
                got = model(
                    input_ids=ids,
                    cache=new_cache(model),
                    use_cache=True,
                    position_ids=torch.arange(3, device=device)[None],
                ).logits.float()
            want = model(input_ids=ids, use_cache=False).logits.float()
    except CascadeError:
        return False
    tol = (1e-2 if want.dtype == torch.bfloat16 else 1e-4) * float(want.abs().max()) + 1e-6
    return bool((got - want).abs().max() <= tol)


def groups_of(chains: Sequence[Chain]) -> tuple[tuple[int, int, Piece], ...]:
    """Per piece, the runs of consecutive rows whose chains hold it (by identity) at the same depth: rows
    sorted by their chains' pieces read each piece in one run."""
    out: list[tuple[int, int, Piece]] = []
    open_runs: dict[int, tuple[int, Piece]] = {}  # depth -> (first row, piece) of the run still open
    for j, chain in enumerate(chains):
        for depth in list(open_runs):
            start, piece = open_runs[depth]
            if depth >= len(chain) or chain[depth] is not piece:
                out.append((start, j, piece))
                del open_runs[depth]
        for depth, piece in enumerate(chain):
            if depth not in open_runs:
                open_runs[depth] = (j, piece)
    out += [(start, len(chains), piece) for start, piece in open_runs.values()]
    return tuple(out)


def _own_state(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, group: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each row's queries `[R, H_kv, M, D]` over its own keys under its own mask `[R, 1, M, W]`:
    `(out [R, H_kv, M, Dv], lse [R, H_kv, M])` in float32 or wider."""
    stat = torch.promote_types(q.dtype, torch.float32)
    visible, bias = layout.masks(group, q.dtype)
    if q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and q.dtype in (torch.float32, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
        return out.to(stat), lse.to(stat)
    scores = (q.to(stat) @ k.to(stat).transpose(-1, -2)) * scale  # [R, H_kv, M, W]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [R, H_kv, M]
    return torch.exp(scores - lse[..., None]) @ v.to(stat), lse


def cascade_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [R, H, T, D]
    key: torch.Tensor,  # [R, H_kv, W, D], the rows' own cache
    value: torch.Tensor,  # [R, H_kv, W, Dv]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the active layout's pieces and the rows' own tokens (`[R, T, H, Dv]`)."""
    layout = _ACTIVE.get()
    if layout is None:
        raise CascadeError("cascade attention ran without a layout (use `cascade`)")
    extra = [n for n in UNMODELLED if kwargs.get(n) is not None]
    if extra or dropout or attention_mask is not None or callable(getattr(module, "expand_kv", None)):
        raise CascadeError(f"{type(module).__name__} passes {extra or 'a mask or dropout'} to its attention")
    rows, heads, t, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = float(scaling if scaling is not None else d**-0.5)
    qs = query.reshape(rows, kv_heads, group * t, d)  # head = kv head * group + g
    out, lse = _own_state(qs, key, value, layout, group, scale)
    layer = int(getattr(module, "layer_idx", 0))
    for a, b, piece in layout.groups:
        n = b - a
        stacked = qs[a:b].transpose(0, 1).reshape(1, kv_heads, n * group * t, d)  # [1, H_kv, M, D]
        k, v = piece.layers[layer]
        po, pl = fused_state(stacked, k, v, scale)  # [1, H_kv, M, Dv], [1, H_kv, M]
        po = po[0].reshape(kv_heads, n, group * t, -1).transpose(0, 1).to(out.dtype)
        pl = pl[0].reshape(kv_heads, n, group * t).transpose(0, 1).to(lse.dtype)
        if n == rows:
            _, lse = merge_into(out, lse, po, pl)
        else:  # out in place; every row saw its own key
            _, lse[a:b] = merge_into(out[a:b], lse[a:b], po, pl)
    out = out.reshape(rows, heads, t, -1).to(query.dtype)
    return out.transpose(1, 2), None  # [R, T, H, Dv]; the layer's reshape copies it


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The layout holds the masks; Hugging Face's would go unused."""
    return None


@contextmanager
def cascade(model: PreTrainedModel, layout: Layout) -> Iterator[None]:
    """Run `model`'s attention over `layout` while the block lasts (the caller checked `cascade_reason`)."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, cascade_forward)
        AttentionMaskInterface.register(NAME, _no_mask)
    config = model.config
    original = config._attn_implementation
    token = _ACTIVE.set(layout)
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = original
        _ACTIVE.reset(token)
