"""The engine's attention: shared-past attention when a forward continues a resident past, else GQA SDPA.

With a `SharedPast` active (`engine_attention(model, shared=...)`), every attention layer runs
`treetrain.models.shared_past.shared_attention`: the rows' own tokens from the layer's arguments, the past
from the resident pieces, never concatenated. The decomposition reproduces what the layer asks of its
attention function, whichever Hugging Face kernel the user configured (`sdpa` or `eager`): the scaling,
a sliding window (a mask per piece), attention sinks (`s_aux`, gpt-oss: one more logit per head in the
log-sum-exp merge), attention soft-capping (`softcap`, Gemma 2: on the reference kernel, since the fused
ones take no score modification; `shared_past_kernel_note` says so), a value head of another size than the
query/key head, latent caches expanded per piece (MLA: the layer's `expand_kv`), and layers that reuse an
earlier layer's KV (Gemma 3n/4: `kv_source_layer`). Models whose attention has terms it does not model
(position biases, dropout), whose attention does not go through transformers' attention interface, whose
cache turns out to hold other tensors than their attention reads, or that use another implementation keep
the concatenated path; `shared_past_reason` names why, and `treetrain plan` prints it.

Without a past (flat forwards, a first chunk):

Why: with a past, a forward needs an explicit causal mask, and Hugging Face's `sdpa` path then expands the
keys and values to every query head (`repeat_kv`) before calling `scaled_dot_product_attention`. Against a
long resident past that expansion, kept for backward, is the largest buffer of a replay step: (query heads
÷ KV heads) copies of the whole past per layer. On CPU, torch's SDPA takes grouped-query inputs with a mask
directly (`enable_gqa=True`), so `engine_attention` routes the engine's forwards there. On CUDA a mask with
`enable_gqa` would fall back to the math kernel, so there, and for `eager`, the model's own path runs.

Example:
    >>> with engine_attention(model):                                   # doctest: +SKIP
    ...     out = model.model(input_ids=ids, position_ids=pos, cache=cache)
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils.import_utils import is_torch_greater_or_equal

from treetrain.models.indexer_state import INDEXED_REASON, indexed_layers
from treetrain.models.past_routes import expanded_in_one_call, expanded_past
from treetrain.models.recurrent_state import attending_layer, recurrent_layers, unkeyed_layers
from treetrain.models.shared_past import HeldPieces, ScoreForm, SharedPast, shared_attention

NAME = "treetrain_sdpa"
SHARED = "treetrain_shared_past"
#: Implementations whose semantics the decomposition reproduces (HF's `eager` takes its softmax in float32
#: even for a float64 model; the decomposition keeps the model's precision, which the tests' noise floor,
#: measured with float32 islands, covers).
DECOMPOSABLE = frozenset({"sdpa", "eager", NAME})
#: Attention arguments the decomposition does not model.
_UNMODELLED = ("position_bias",)
#: Config fields of attention soft-capping: torch's fused kernels with a log-sum-exp take no score
#: modification, so shared-past attention runs its plain-PyTorch reference for such a model.
SOFTCAP_CONFIG = ("attn_logit_softcapping",)
CACHE_MISMATCH = "its cache holds other tensors than the keys and values its attention reads"
OWN_MASK = (
    "its attention takes a mask of its own making (as Doge's dynamic mask: a learned bias per key), which "
    "shared-past attention, masking by position alone, does not reproduce"
)


class PastLayoutError(RuntimeError):
    """A layer attends over something shared-past attention does not reproduce from the resident pieces:
    keys and values of other shapes than the cache holds, or a mask of the layer's own making."""

    def __init__(self, message: str, reason: str = CACHE_MISMATCH) -> None:
        super().__init__(message)
        self.reason = reason
        """Why the model takes the concatenated path, as `shared_past_reason` says it."""


#: Model classes found, on a forward, to attend over something the resident pieces do not reproduce, and
#: why (`PastLayoutError.reason`); they take the concatenated path.
_LAYOUT_MISMATCH: dict[type, str] = {}


def mark_layout_mismatch(model: PreTrainedModel, reason: str = CACHE_MISMATCH) -> None:
    _LAYOUT_MISMATCH[type(model)] = reason


@dataclass(frozen=True)
class _Active:
    past: SharedPast
    positions: torch.Tensor  # [K, T]


_ACTIVE: ContextVar[_Active | None] = ContextVar("treetrain_shared_past", default=None)
#: The windows of the masks the running forward built (None for a plain causal one), in order.
_MASKS: ContextVar[tuple[int | None, ...]] = ContextVar("treetrain_shared_masks", default=())


def shared_past_reason(model: PreTrainedModel) -> str | None:
    """None when `model`'s attention decomposes over resident pieces; otherwise why it does not."""
    impl = str(getattr(model.config, "_attn_implementation", None))
    if impl not in DECOMPOSABLE:
        return f"attention implementation {impl!r} is not decomposed"
    if not (getattr(model, "_supports_attention_backend", False) or hybrid_attention_uses_interface(model)):
        return f"{type(model).__name__}'s attention does not go through transformers' attention interface"
    if type(model) in _LAYOUT_MISMATCH:
        return _LAYOUT_MISMATCH[type(model)]
    if indexed_layers(model):
        return INDEXED_REASON
    return None


_INTERFACE = "ALL_ATTENTION_FUNCTIONS.get_interface"
_READS_INTERFACE: dict[type, bool] = {}
#: A module's decoder block from its name (`model.layers.3.shared_transformer.self_attn` -> 3).
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def _reads_interface(cls: type) -> bool:
    if cls not in _READS_INTERFACE:
        try:
            _READS_INTERFACE[cls] = _INTERFACE in inspect.getsource(getattr(cls, "forward"))  # noqa: B009
        except (OSError, TypeError):
            _READS_INTERFACE[cls] = False
    return _READS_INTERFACE[cls]


def hybrid_attention_uses_interface(model: PreTrainedModel) -> bool:
    """Whether a Gated DeltaNet hybrid's attention layers all look their attention function up in
    transformers' interface. Such classes (Qwen3.5, Qwen3-Next, ...) do not set `_supports_attention_backend`
    because their linear-attention layers have no attention function, yet their attention layers can read
    the resident pieces in place; the split probe then checks it by behaviour. True for a stack of
    linear-attention layers only: there is nothing to concatenate. A module without a layer index of its own
    (Zamba 2's shared block, `layer_idx = -1`, run by several layers) counts for the block it sits in."""
    recurrent = recurrent_layers(model)
    if not recurrent:
        return False
    wanted = set(range(int(model.config.get_text_config(decoder=True).num_hidden_layers))) - unkeyed_layers(
        model
    )
    found: set[int] = set()
    for name, m in model.named_modules(remove_duplicate=False):
        if not _reads_interface(type(m)):
            continue
        idx = getattr(m, "layer_idx", None)
        block = _BLOCK_INDEX.search(name)
        if isinstance(idx, int) and idx >= 0:
            found.add(idx)
        elif block is not None:
            found.add(int(block.group(1)))
    return wanted <= found  # with no attention layer at all, nothing is concatenated either


def shared_past_kernel_note(model: PreTrainedModel) -> str | None:
    """Why shared-past attention runs its plain-PyTorch reference instead of a fused kernel, or None."""
    config = model.config.get_text_config(decoder=True)
    for name in SOFTCAP_CONFIG:
        if getattr(config, name, None):
            return f"{name} (attention soft-capping): the fused kernels take no score modification"
    return None


def shared_past_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [K, H, T, D]
    key: torch.Tensor,  # [K, H_kv, T, D], the rows' own tokens
    value: torch.Tensor,  # [K, H_kv, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention over the active shared past and the rows' own tokens (`[K, T, H, D]`)."""
    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError("shared-past attention ran without an active past (use engine_attention)")
    extra = [name for name in _UNMODELLED if kwargs.get(name) is not None]
    if extra or dropout:
        raise RuntimeError(
            f"{type(module).__name__} passes {extra or ['dropout']} to its attention, which shared-past attention "
            "does not model; this model must use the concatenated path (shared_past_reason)"
        )
    if attention_mask is not None:  # the model's own masks are `_no_mask`'s None: the layer made this one
        raise PastLayoutError(f"{type(module).__name__} attends under a mask of its own making", OWN_MASK)
    layer = kv_source_layer(module)
    past, grads, starts = active.past.held(layer)  # a context group's other pieces are attended elsewhere
    expand = getattr(module, "expand_kv", None)
    tie = None
    grouped = active.past.exchange is not None and active.past.exchange.sharded
    if callable(expand) and grouped:  # as below, in one call of the same shape on every rank of the group
        like = active.past.layer(layer)[0][0]
        past, grads, tie = expanded_in_one_call(expand, past, grads, query, like)
    elif callable(expand):  # MLA: the cache holds latents, which the layer expands to keys and values
        past, grads = expanded_past(expand, past, grads, anchor=query)
    _check_past_shapes(module, layer, past, key, value)
    window = kwargs.get("sliding_window") or _mask_window()
    chunk = layer_chunk(module)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # [H], gpt-oss's learned per-head sink logits
    softcap = kwargs.get("softcap")  # Gemma 2's attention soft-capping
    form = ScoreForm(
        float(scaling if scaling is not None else query.shape[-1] ** -0.5),
        int(window) if window else None,
        float(softcap) if softcap else None,
        chunk,
    )
    out = shared_attention(
        query, key, value, active.positions, past, grads, form, sinks=sinks,
        held=HeldPieces(starts, active.past.exchange),
    )  # fmt: skip
    if tie is not None:
        out = out + tie
    return out, None


#: The layer type of chunked attention (Llama 4), whose chunk is the config's `attention_chunk_size`.
CHUNKED = "chunked_attention"


def layer_chunk(module: torch.nn.Module) -> int | None:
    """The attention chunk of `module`'s layer: the config's `attention_chunk_size` when its layer type is
    chunked attention (Llama 4's RoPE layers), else None. The layer passes no chunk to its attention
    function; Hugging Face applies it only through the chunked mask its model builds for those layers."""
    config = getattr(module, "config", None)
    types = list(getattr(config, "layer_types", None) or [])
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int) or not 0 <= layer < len(types) or types[layer] != CHUNKED:
        return None
    size = getattr(config, "attention_chunk_size", None)
    return int(size) if size else None


def kv_source_layer(module: torch.nn.Module) -> int:
    """The cache index whose KV `module` attends over: its own `layer_idx`, or for a layer that reuses an
    earlier layer's KV (Gemma 3n and Gemma 4: `is_kv_shared_layer`) the last layer before it of the same
    layer type that stores its KV for sharing (`kv_sharing_modes[j] == "store"`). A module without an index
    of its own (Zamba 2's shared block, one module run by several layers) attends over the KV its layer has
    just written into the engine's cache (`attending_layer`)."""
    own = getattr(module, "layer_idx", 0)
    if not isinstance(own, int) or own < 0:  # one module for several layers (Zamba 2's shared block)
        current = attending_layer()
        if current is None:
            raise RuntimeError(f"{type(module).__name__} has no layer index and wrote no KV before attending")
        return current
    layer = own
    if not getattr(module, "is_kv_shared_layer", False):
        return layer
    config = getattr(module, "config", None)
    types = list(getattr(config, "layer_types", None) or [])
    modes = list(getattr(config, "kv_sharing_modes", None) or [])
    kind = types[layer] if layer < len(types) else None
    for j in range(min(layer, len(modes), len(types)) - 1, -1, -1):
        if modes[j] == "store" and types[j] == kind:
            return j
    raise RuntimeError(
        f"{type(module).__name__} (layer {layer}) reuses KV, but no earlier layer of its type stores any"
    )


def _check_past_shapes(
    module: torch.nn.Module,
    layer: int,
    past: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    key: torch.Tensor,  # [K, H_kv, T, D]
    value: torch.Tensor,  # [K, H_kv, T, Dv]
) -> None:
    """The resident pieces must be what the layer attends over: its keys' and values' heads and sizes."""
    for k, v in past:
        if k.shape[1] != key.shape[1] or k.shape[-1] != key.shape[-1] or v.shape[-1] != value.shape[-1]:
            raise PastLayoutError(
                f"{type(module).__name__} (layer {layer}) attends over keys {tuple(key.shape[1::2])} and values "
                f"{tuple(value.shape[1::2])} (heads, head size), but its cache holds {tuple(k.shape[1::2])} and "
                f"{tuple(v.shape[1::2])}: the cache stores something other than the attention's keys and values"
            )


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Shared-past attention builds its masks from positions; Hugging Face's mask would go unused. What
    it records is the mask's window (`local_size`, which only transformers' sliding-window masks pass):
    some layers (PhiMoE, Doge) window their attention only through the mask their model builds, never
    passing `sliding_window` to the attention function."""
    size = kwargs.get("local_size")
    window = int(size) if size else None
    if window is not None and not _is_sliding_window(kwargs.get("mask_function"), window):
        window = -1  # a chunked mask passes its chunk as `local_size` too: no window to take
    _MASKS.set((*_MASKS.get(), window))
    return None


def _is_sliding_window(mask_function: Any, window: int) -> bool:
    """Whether `mask_function` (batch, head, query, key -> visible) is the causal sliding window of
    `window` keys, read at the positions where a window and a chunk of that size differ (a few dozen,
    whatever the window: this runs at every mask call)."""
    pairs = [
        (q, k)
        for q in (window - 1, window, 2 * window - 1, 2 * window, 3 * window)
        for k in (q - window, q - window + 1, q - 1, q, q + 1)
        if k >= 0
    ]
    q, kv = torch.tensor(pairs).T  # [N], [N]
    zero = torch.zeros((), dtype=torch.long)
    try:
        got = torch.as_tensor(mask_function(zero, zero, q, kv)).expand(q.shape)  # [N]
    except Exception:  # a mask function of another form: not one to read a window from
        return False
    return bool(torch.equal(got.bool(), (kv <= q) & (kv > q - window)))


def _mask_window() -> int | None:
    """The window of the masks this forward built, when they are all one sliding window (a layer that
    passes no `sliding_window` then has only that mask to take it from); None otherwise."""
    built = set(_MASKS.get())
    window = next(iter(built)) if len(built) == 1 else None
    return window if window is not None and window > 0 else None


_GQA = is_torch_greater_or_equal("2.5")  # SDPA's `enable_gqa`


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,  # [B, H_kv, S, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's `sdpa` attention, with grouped-query heads passed to SDPA as they are (CPU only)."""
    plain = query.device.type != "cpu" or not _GQA or kwargs.get("position_bias") is not None
    if plain or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )  # fmt: skip
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and causal),
        enable_gqa=key.shape[1] != query.shape[1],
    )  # fmt: skip  # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, D]


def _register() -> None:
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, gqa_sdpa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    if SHARED not in AttentionInterface._global_mapping:
        AttentionInterface.register(SHARED, shared_past_forward)
        AttentionMaskInterface.register(SHARED, _no_mask)


@contextmanager
def engine_attention(
    model: PreTrainedModel, shared: SharedPast | None = None, positions: torch.Tensor | None = None
) -> Iterator[None]:
    """Run `model` with the engine's attention while the block lasts.

    With `shared` (and the rows' `positions`, `[K, T]`), every layer attends over that past piece by piece
    (the caller checked `shared_past_reason`); without it, an `sdpa` model runs `gqa_sdpa_forward`.
    """
    config = model.config
    original = getattr(config, "_attn_implementation", None)
    if shared is not None:
        if positions is None:
            raise ValueError("a shared past needs the rows' positions")
        name = SHARED
    elif (
        original == "sdpa"
        and getattr(model, "_supports_attention_backend", False)
        and not indexed_layers(model)
    ):
        name = NAME  # a model with attention of its own branches on the name "sdpa": it keeps it (an
        # indexed layer applies its top-k mask only under "sdpa" or "eager")
    else:
        yield
        return
    _register()
    token = _ACTIVE.set(_Active(shared, positions) if shared is not None and positions is not None else None)
    masks = _MASKS.set(())
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = original
        _ACTIVE.reset(token)
        _MASKS.reset(masks)
