"""One forward through a Hugging Face decoder against explicit past KV.

Everything the engine does to a model goes through `decoder_forward`: the tree replay, the scoring pass and
the flat reference all call it, so they differ only in how sequences are split, never in model code.
The language-model head is kept apart (`output_head`) so logprobs can be computed for the few positions
that need them, in chunks, without `[B, T, V]` logits.

Example:
    >>> out = decoder_forward(model, ids, positions, past=None)        # doctest: +SKIP
    >>> out.hidden.shape, out.keys[0].shape                            # doctest: +SKIP
    (torch.Size([B, T, H]), torch.Size([B, H_kv, T, D]))
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from treetrain.models import indexer_state, rwkv_state
from treetrain.models.attention import (
    PastLayoutError,
    engine_attention,
    mark_layout_mismatch,
    shared_past_reason,
)
from treetrain.models.layer_entry import HybridEntry, IndexedEntry, LayerEntry, entry_tensors
from treetrain.models.logit_head import output_head
from treetrain.models.lora import unwrap
from treetrain.models.past_routes import concatenated
from treetrain.models.recurrent_state import (
    EngineCache,
    argument_state_mixers,
    capturing,
    hybrid_layers,
    recurrent_layers,
    stateless_layers,
)
from treetrain.models.shared_past import LayerKV, SharedPast

__all__ = [
    "DecoderOutput",
    "HybridEntry",
    "IndexedEntry",
    "LayerEntry",
    "LayerKV",
    "SharedPast",
    "base_model",
    "concat_past",
    "decoder_forward",
    "decoder_layers",
    "output_head",
]


@dataclass(frozen=True)
class DecoderOutput:
    """Hidden states of the new tokens and the state they produced (a view into the cache, graph kept).

    An attention layer's entry is its keys and values; a recurrent layer's (index in `recurrent`) is its
    conv window and recurrent state before each row's last real token (`treetrain.models.recurrent_state`);
    a hybrid layer's (index in `states`) is its keys and values and that state; an indexed attention
    layer's (index in `index_keys`) its keys and values and its indexer's keys.
    """

    hidden: torch.Tensor  # [B, T, H]
    keys: tuple[torch.Tensor, ...]  # per layer [B, H_kv, T, D]; recurrent layers [B, C, kernel - 1]
    values: tuple[torch.Tensor, ...]  # per layer [B, H_kv, T, D]; recurrent layers [B, H_v, D_k, D_v]
    recurrent: frozenset[int] = frozenset()
    """Layers whose entries are not per-token KV: recurrent state, or empty for a stateless layer."""
    states: Mapping[int, LayerKV] = field(default_factory=dict)
    """The (conv state, recurrent state) of each hybrid layer (KV and a recurrent mixer), by index."""
    index_keys: Mapping[int, torch.Tensor] = field(default_factory=dict)
    """The indexer keys `[B, 1, T, D_index]` of each indexed attention layer, by index."""

    def entry(self, layer: int) -> LayerEntry:
        """Layer `layer`'s entry over every row and position: a `HybridEntry` for a hybrid layer, an
        `IndexedEntry` for an indexed attention layer."""
        kv = (self.keys[layer], self.values[layer])
        state = self.states.get(layer)
        if layer in self.index_keys:
            return IndexedEntry(kv, self.index_keys[layer])
        return kv if state is None else HybridEntry(kv, state)

    def entries(self) -> list[LayerEntry]:
        """Every layer's entry over every row and position (`entry`)."""
        return [self.entry(i) for i in range(len(self.keys))]

    def own_entries(self, row: int, start: int, length: int) -> list[LayerEntry]:
        """Row `row`'s resident state for its positions `start .. start + length - 1`, graph kept: per
        attention layer that span of its KV (an overlap token before `start` and padding after it cut away),
        per recurrent layer the row's state as it is (taken before the row's last real token), per hybrid
        layer both, per indexed attention layer the span of its KV and of its indexer's keys."""
        span = slice(start, start + length)
        entries: list[LayerEntry] = []
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if i in self.recurrent:
                entries.append((k[row : row + 1], v[row : row + 1]))
                continue
            kv = (k[row : row + 1, :, span], v[row : row + 1, :, span])
            state = self.states.get(i)
            index_keys = self.index_keys.get(i)
            if index_keys is not None:
                entries.append(IndexedEntry(kv, index_keys[row : row + 1, :, span]))
            elif state is None:
                entries.append(kv)
            else:
                entries.append(HybridEntry(kv, (state[0][row : row + 1], state[1][row : row + 1])))
        return entries


#: Attribute names under which a decoder stack keeps its blocks: `layers` (Llama and most), `h` (GPT-2,
#: GPT-J, Falcon, BLOOM, GPTBigCode, CTRL), `blocks` (MPT).
BLOCK_LISTS = ("layers", "h", "blocks")


def base_model(model: PreTrainedModel) -> nn.Module:
    """The decoder stack without the LM head (`model.model`, `model.transformer`, `model.model.decoder`, as
    transformers' `get_decoder` finds it; PEFT-wrapped models are unwrapped, their adapter layers stay in
    place)."""
    model = unwrap(model)
    try:
        found = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        found = None
    for base in (found, getattr(model, "model", None), getattr(model, "transformer", None)):
        if isinstance(base, nn.Module) and base is not model and _blocks(base) is not None:
            return base
    raise TypeError(
        f"{type(model).__name__} has no decoder stack with its blocks in "
        f"{', '.join(f'`.{n}`' for n in BLOCK_LISTS)}; not a supported causal LM"
    )


def _blocks(base: nn.Module) -> nn.ModuleList | None:
    for name in BLOCK_LISTS:
        blocks = getattr(base, name, None)
        if isinstance(blocks, nn.ModuleList):
            return blocks
    return None


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder's blocks, wherever the family keeps them (`BLOCK_LISTS`)."""
    blocks = _blocks(base_model(model))
    assert blocks is not None  # base_model refuses a stack without them
    return blocks


def cache_layer_indices(model: nn.Module) -> frozenset[int]:
    """The cache indices the model's modules own (`layer_idx` >= 0). A block shared by several layers
    (Zamba's and Zamba 2's transformer block) has -1 or None: it writes at the index of the layer running it.
    """
    return frozenset(
        idx for m in model.modules() if isinstance(idx := getattr(m, "layer_idx", None), int) and idx >= 0
    )


_CACHE_KWARG: dict[type, str] = {}


def _cache_kwarg(module: nn.Module) -> str:
    """transformers 5.x names the argument `cache`; 4.x named it `past_key_values`."""
    cls = type(module)
    if cls not in _CACHE_KWARG:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[cls]


def _anchor(model: PreTrainedModel, device: torch.device) -> torch.Tensor | None:
    """A leaf under autograd that keeps the G routing of resident pieces (`_Into`) in the graph while the
    model trains; None for a frozen model. Not one of the model's parameters: under ZeRO-3 a parameter
    outside its module's forward is an empty partition, and the gradient node autograd makes for it there
    would expect that empty shape for the parameter's real gradient."""
    if not any(p.requires_grad for p in model.parameters()):
        return None
    return torch.zeros((), device=device, requires_grad=True)


class PastLengthCache(DynamicCache):
    """The cache of a forward whose past shared-past attention reads in place: it holds only the rows' own
    tokens, yet reports the past's length too, as a cache holding that past would. Layers that read their
    positions off the cache (Llama 4's temperature tuning of its NoPE layers) then see absolute positions."""

    def __init__(self, past_length: int) -> None:
        super().__init__()
        self.past_length = past_length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past_length + int(super().get_seq_length(layer_idx))


def decoder_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # [B, T]
    positions: torch.Tensor,  # [B, T]
    past: Sequence[LayerEntry] | SharedPast | None,
    *,
    concatenate: bool = False,
    lengths: Sequence[int] | None = None,
) -> DecoderOutput:
    """Run the decoder on `input_ids` continuing `past`.

    `past` is a `SharedPast` (resident pieces, `[1, H_kv, P_i, D]` per layer, at positions `0..P-1`), or one
    per-layer list of `[1 or B, H_kv, P, D]` tensors. Every row attends to the same past. Where the model's
    attention decomposes (`shared_past_reason`), the pieces are read in place by shared-past attention;
    otherwise they are concatenated and broadcast to the B rows, with gradients routed into the pieces' G
    accumulators (always, with `concatenate`). Rows are right-padded by the caller; a real token never
    attends to padding after it. `lengths` are the rows' real lengths (all `T` if omitted): a recurrent
    layer's state is taken before each row's last real token, and read from the past's last piece.
    """
    base = base_model(model)
    bsz = input_ids.shape[0]
    recurrent = recurrent_layers(unwrap(model))
    stateless = stateless_layers(unwrap(model))
    hybrid = hybrid_layers(unwrap(model))
    unkeyed = (recurrent - hybrid) | stateless  # no sequence axis in their entries
    if past is not None and not isinstance(past, SharedPast):
        past = SharedPast.of([list(past)], recurrent=unkeyed) if len(past) else None
    if past is not None and not past.pieces:
        past = None
    shared = (
        not concatenate
        and past is not None
        and shared_past_reason(unwrap(model)) is None
        and entry_tensors(past.pieces[0][0])[0].shape[0] == 1
    )
    if past is not None and past.exchange is not None and past.exchange.sharded and not shared:
        raise ValueError(
            f"a context group's past is read piece by piece, but {type(unwrap(model)).__name__} takes the "
            f"concatenated past ({shared_past_reason(unwrap(model)) or 'rows of several pasts'})"
        )
    anchor = _anchor(model, input_ids.device)
    cache: DynamicCache = PastLengthCache(past.length) if shared and past is not None else DynamicCache()
    indexed = indexer_state.indexed_layers(unwrap(model))
    if indexed and not shared:  # the past's indexer keys go ahead of the rows' own (`indexer_state`)
        pieces = past.pieces if past is not None else None
        cache = indexer_state.indexed_cache(unwrap(model), len(_blocks_of(base)), pieces, bsz)
    if recurrent or stateless:
        cache = EngineCache(len(_blocks_of(base)), recurrent, past, bsz, anchor, stateless, hybrid)
    past_len = 0
    if past is not None and not shared:
        past_len = past.length
        for layer, kv in enumerate(concatenated(past, bsz, anchor)):
            if kv is not None:
                cache.update(kv[0], kv[1], layer)
    kwargs: dict[str, Any] = {_cache_kwarg(base): cache}
    rows = torch.as_tensor(
        list(lengths) if lengths is not None else [input_ids.shape[1]] * bsz, device=input_ids.device
    )  # [B]
    capture = capturing(unwrap(model), cache, rows) if isinstance(cache, EngineCache) else nullcontext()
    argument = isinstance(cache, EngineCache) and bool(argument_state_mixers(unwrap(model)))
    width = input_ids.shape[1]
    try:
        with engine_attention(model, past if shared else None, positions), capture, ExitStack() as stack:
            ids = input_ids
            if argument:  # RWKV: the state goes in as its forward's list argument (`rwkv_state`)
                assert isinstance(cache, EngineCache)
                dtype = next(base.parameters()).dtype  # the embeddings', which the shifts take
                kwargs = {"state": rwkv_state.state_list(unwrap(model), cache, bsz, dtype, input_ids.device)}
                shifts = stack.enter_context(rwkv_state.recording(unwrap(model), cache))
                ids = rwkv_state.pad_one_token(input_ids) if width == 1 else input_ids
            out = base(input_ids=ids, position_ids=positions, use_cache=True, **kwargs)
            if argument:
                rwkv_state.finish(cache, shifts, out.state)  # type: ignore[arg-type]
    except PastLayoutError as exc:
        if not shared:
            raise
        mark_layout_mismatch(unwrap(model), exc.reason)  # from now on this class takes the concatenated path
        return decoder_forward(model, input_ids, positions, past, lengths=lengths)
    returned: Any = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    states = {i: cache.states(i) for i in hybrid}  # type: ignore[attr-defined]
    for i, layer in enumerate(returned.layers):
        if i in recurrent and i not in hybrid:
            conv, state = cache.states(i)  # type: ignore[attr-defined]
            keys.append(conv)
            values.append(state)
        elif i in stateless:  # an MLP or experts block: an empty entry keeps the layer indices aligned
            keys.append(input_ids.new_zeros((bsz, 0), dtype=out.last_hidden_state.dtype))
            values.append(keys[-1])
        else:
            keys.append(layer.keys[:, :, past_len:, :])
            values.append(layer.values[:, :, past_len:, :])
    index_keys = indexer_state.own_index_keys(unwrap(model), returned, past_len) if indexed else {}
    return DecoderOutput(
        out.last_hidden_state[:, :width], tuple(keys), tuple(values), unkeyed, states, index_keys
    )


def _blocks_of(base: nn.Module) -> nn.ModuleList:
    blocks = _blocks(base)
    assert blocks is not None  # base_model refuses a stack without them
    return blocks


def concat_past(pieces: Sequence[Sequence[LayerKV]]) -> list[LayerKV] | None:
    """Concatenate per-unit KV along the sequence axis (root side first; KV models only)."""
    if not pieces:
        return None
    if len(pieces) == 1:
        return list(pieces[0])
    n_layers = len(pieces[0])
    return [
        (
            torch.cat([p[layer][0] for p in pieces], dim=-2),
            torch.cat([p[layer][1] for p in pieces], dim=-2),
        )
        for layer in range(n_layers)
    ]
