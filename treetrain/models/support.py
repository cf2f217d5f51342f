"""Which models the tree engine can run, and a clear refusal for the rest.

The engine splits every sequence at node boundaries and continues from stored KV. That is exact only when a
layer's whole state is its per-token keys and values over *all* earlier positions, or a recurrent state the
engine keeps resident too (Gated DeltaNet, Kimi delta attention, Mamba and RWKV layers,
`treetrain.models.recurrent_state`), or both in one layer (Zamba, Zamba 2 and Falcon-H1's hybrid layers,
`treetrain.models.layer_entry.HybridEntry`), or KV and an indexer's keys (DeepSeek V3.2's, GLM-5's and AXK2's
indexed sparse attention, `treetrain.models.indexer_state`); other recurrent or linear attention layers carry a running
state it cannot take (a model that keeps it outside the Cache the engine passes, in a forward argument, a
cache class of its own or on its modules, is refused saying where: `treetrain.models.foreign_state`), and dynamic RoPE variants choose their frequencies from
the longest position *in each forward call*, so a prefix evaluated alone rotates differently than inside
the whole sequence. The engine also computes logprobs from the LM head directly, so the head applies what
the family does to its logits (`treetrain.models.logit_head`: scaling, final soft-capping); a model that
does something else after the head would train on the wrong distribution. Rather than risk a silent wrong
gradient, such models are refused with the reason; a short probe backs up the static checks:
split-versus-whole hidden states, and head-only logprobs against the model's own. A sliding window shorter than the sequences is
accepted once a probe that splits inside the window and runs past it agrees with the whole forward.

Exactness is also checked by behaviour, because names miss things and config fields mislead (a field may
belong to another head): one watched forward in the modules' own modes (`treetrain.models.observed_forward`)
finds dropout that runs and decoder blocks that run more than once per forward (a looped transformer, refused
as such before any probe splits a sequence), and the same tokens run twice must agree (functional dropout
reading a config field, such as Starcoder2's `residual_dropout`). A PEFT wrapper is judged by the modules
inside it, and every probe leaves each module in the mode it found it in (`treetrain.models.module_modes`).
Bidirectional attention (a prefix that sees later tokens), more KV caches than attention layers (a layer
that reuses an earlier layer's KV, as in Gemma 3n/4, keeps none of its own), a forward that returns no
cache, and layers that attend over other tensors than they cache are refused with those reasons, and any
exception inside a probe becomes an `UnsupportedModelError` naming the model type and the step.

Example:
    >>> check_supported(model, max_sequence_length=4096)        # doctest: +SKIP
    >>> gate = SupportGate()                                      # doctest: +SKIP
    >>> gate.require(model, 4096); gate.require(model, 512)       # the second call does nothing  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from treetrain.errors import TreetrainError
from treetrain.models.attention import shared_past_reason
from treetrain.models.continuation import continue_pieces, recompute_error, split_error
from treetrain.models.decoder import (
    cache_layer_indices,
    decoder_forward,
    decoder_layers,
    output_head,
)
from treetrain.models.foreign_state import forward_state_reason, module_state_reason, state_argument
from treetrain.models.indexer_state import other_indexer_reason
from treetrain.models.lora import unwrap
from treetrain.models.module_modes import evaluating, training
from treetrain.models.observed_forward import dropout_fields, observe_forward
from treetrain.models.recurrent_state import (
    HYBRID_LAYER_TYPES,
    RECURRENT_LAYER_TYPES,
    STATELESS_LAYER_TYPES,
    argument_state_mixers,
    recurrent_layers,
    unkeyed_layers,
    unsupported_mixer,
)

#: Layer types whose state is plain KV over every earlier position.
FULL_ATTENTION_TYPES = frozenset({"full_attention"})
#: Layer types with a sliding window (a hybrid layer's attention may have one: `hybrid_sliding`).
SLIDING_TYPES = frozenset({"sliding_attention", "hybrid_sliding"})
#: Layer types of chunked attention (Llama 4): a query sees the earlier keys of its own fixed-size chunk,
#: which shared-past attention builds from absolute positions (`treetrain.models.attention.layer_chunk`).
CHUNKED_TYPES = frozenset({"chunked_attention"})
#: Model types known to keep recurrent or compressed state.
RECURRENT_MODEL_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "jamba",
        "falcon_mamba",
        "rwkv",
        "recurrent_gemma",
        "qwen3_next",
        "bamba",
        "zamba",
        "zamba2",
        "xlstm",
    }
)
#: Config flags that make attention bidirectional, with the value that does.
BIDIRECTIONAL_FLAGS: dict[str, bool] = {"use_bidirectional_attention": True, "is_causal": False}
#: What a layer type the engine does not run keeps or reads that resident KV does not hold: the refusal
#: names it.
LAYER_TYPE_REASONS: dict[str, str] = {
    "conv": "short-convolution layers: their conv window is state the engine does not keep resident",
}
#: Layer types of indexed sparse attention (DeepSeek V3.2, GLM-5, AXK2): each query attends to the top k
#: earlier positions its indexer picks; the indexer's keys are resident beside the latents
#: (`treetrain.models.indexer_state`).
INDEXED_TYPES = frozenset({"indexed_attention"})
#: RoPE types whose frequencies depend on the longest position of the forward call.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


class UnsupportedModelError(TreetrainError, ValueError):
    """The engine cannot reproduce this model's computation across a tree split; the message says why."""


def _sliding_window(config: object) -> int | None:
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def _rope_types(config: object) -> set[str]:
    """Every `rope_type` in `rope_parameters` (transformers 5, possibly one per layer type) or `rope_scaling`."""
    found: set[str] = set()

    def visit(obj: object) -> None:
        if isinstance(obj, dict):
            kind = obj.get("rope_type", obj.get("type"))
            if isinstance(kind, str):
                found.add(kind)
            for value in obj.values():
                visit(value)

    visit(getattr(config, "rope_parameters", None))
    visit(getattr(config, "rope_scaling", None))
    return found


def active_window(model: PreTrainedModel, max_sequence_length: int) -> int | None:
    """The sliding window, when some layer uses one shorter than `max_sequence_length` (else None)."""
    config = model.config.get_text_config(decoder=True)
    window = _sliding_window(config)
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = window is not None and (not layer_types or any(t in SLIDING_TYPES for t in layer_types))
    return window if uses_window and window is not None and window < max_sequence_length else None


def active_chunk(model: PreTrainedModel, max_sequence_length: int) -> int | None:
    """The attention chunk, when some layer is chunked with chunks shorter than `max_sequence_length`."""
    config = model.config.get_text_config(decoder=True)
    size = getattr(config, "attention_chunk_size", None)
    chunked = any(t in CHUNKED_TYPES for t in getattr(config, "layer_types", None) or [])
    return int(size) if chunked and size and int(size) < max_sequence_length else None


def check_supported(
    model: PreTrainedModel, max_sequence_length: int, *, probe: bool = True, probe_window: bool | None = None
) -> None:
    """Raise `UnsupportedModelError` unless splitting sequences at any point is exact for `model`.

    A sliding window shorter than the sequences is accepted when a probe across the window agrees with
    the whole forward (`probe_window`, by default `probe`); the attention mask then drops the same keys in
    both.
    """
    config = model.config.get_text_config(decoder=True)
    mtype = getattr(config, "model_type", type(model).__name__)
    try:
        decoder_layers(model)
    except TypeError as exc:
        raise UnsupportedModelError(f"model type {mtype!r}: {exc}") from None
    mixer = unsupported_mixer(unwrap(model))
    # Where the model keeps its state, when that is outside the engine's Cache: the true reason, ahead of
    # the generic ones below. The forward that finds state on modules runs only for a model refused anyway
    # (here, or by the split probe): under ZeRO-3 a forward that fails midway is not free.
    supplied = state_argument(unwrap(model)) if argument_state_mixers(unwrap(model)) else None  # RWKV's
    foreign = forward_state_reason(unwrap(model), supplied=supplied)
    if foreign is None and mixer is not None:
        foreign = module_state_reason(unwrap(model))
    if foreign is not None:
        raise UnsupportedModelError(f"model type {mtype!r} {foreign}")
    declared = getattr(config, "layer_types", None) or []
    # With `layer_types` declared, a layer whose block builds a known recurrent mixer counts as recurrent
    # whatever its name (`recurrent_layers`), so none found means attention layers only, which the probes
    # check like any model's; without them, where the state lives is unknown.
    if mtype in RECURRENT_MODEL_TYPES and not declared and not recurrent_layers(unwrap(model)):
        raise UnsupportedModelError(
            f"model type {mtype!r} keeps recurrent state in layers its config does not declare (no `layer_types` "
            "entry 'linear_attention' or 'hybrid'); resident state covers KV and the recurrent layers of the "
            "kinds in `treetrain.models.recurrent_kinds` (Gated DeltaNet, Kimi delta attention, Mamba, Mamba-2, WKV) "
            "only, so tree replay is refused"
        )
    if mixer is not None:
        raise UnsupportedModelError(f"model type {mtype!r}: {mixer}")
    indexer = other_indexer_reason(unwrap(model))
    if indexer is not None:
        raise UnsupportedModelError(f"model type {mtype!r}: {indexer}")
    odd = sorted(
        set(declared)
        - FULL_ATTENTION_TYPES
        - SLIDING_TYPES
        - CHUNKED_TYPES
        - INDEXED_TYPES
        - RECURRENT_LAYER_TYPES
        - HYBRID_LAYER_TYPES
        - STATELESS_LAYER_TYPES
    )
    if odd:
        why = "; ".join(LAYER_TYPE_REASONS[t] for t in odd if t in LAYER_TYPE_REASONS)
        raise UnsupportedModelError(
            f"model type {mtype!r} has layer types {odd}{f' ({why})' if why else ''}; only full (and covered "
            "sliding) attention, indexed sparse attention, and the recurrent kinds of "
            "`treetrain.models.recurrent_kinds`, are supported"
        )
    dynamic = sorted(_rope_types(config) & LENGTH_DEPENDENT_ROPE)
    if dynamic:
        raise UnsupportedModelError(
            f"model type {mtype!r} uses rope_type {dynamic[0]!r}, whose frequencies depend on the longest position "
            "in each forward call; a prefix evaluated once would rotate differently than inside the full sequence"
        )
    bidirectional = [f for f in BIDIRECTIONAL_FLAGS if getattr(config, f, None) is BIDIRECTIONAL_FLAGS[f]]
    if bidirectional:
        raise UnsupportedModelError(
            f"model type {mtype!r} has bidirectional attention ({bidirectional[0]}="
            f"{BIDIRECTIONAL_FLAGS[bidirectional[0]]}): a position sees later tokens, so a shared prefix "
            "evaluated once cannot stand for it inside each longer sequence"
        )
    if probe or training(model):
        try:
            # One forward as the model is (its modules' own modes): looped blocks and dropout that runs, known
            # before any probe splits a sequence; then (probing) the same tokens again, and the split.
            _guarded(mtype, "the first forward", lambda: _probe_forward(model, mtype, again=probe))
            if probe:
                _guarded(mtype, "the split probe", lambda: _probe(model, mtype))
        except UnsupportedModelError:
            held = module_state_reason(unwrap(model))
            if held is None:
                raise
            raise UnsupportedModelError(f"model type {mtype!r} {held}") from None
    window = active_window(model, max_sequence_length)
    if window is not None and (probe if probe_window is None else probe_window):
        # The split lands inside the window and the sequence runs past it, so a mask that mishandled the
        # resident past (keys the window should drop, or positions it should keep) shows up.
        _guarded(
            mtype,
            "the sliding-window probe",
            lambda: _probe(model, mtype, length=2 * window + 2, split=window // 2 + 1, window=window),
        )
    chunk = active_chunk(model, max_sequence_length)
    if chunk is not None and (probe if probe_window is None else probe_window):
        # Likewise across a chunk boundary: the split lands inside the first chunk, the second runs past it.
        _guarded(
            mtype,
            "the chunk probe",
            lambda: _probe(
                model,
                mtype,
                length=2 * chunk + 2,
                split=chunk // 2 + 1,
                window=chunk,
                local="attention chunks",
            ),
        )


def _guarded(mtype: str, step: str, run: Callable[[], None]) -> None:
    """Run a probe; anything it raises other than a refusal becomes a refusal naming the model and the step."""
    try:
        run()
    except UnsupportedModelError:
        raise
    except Exception as exc:
        raise UnsupportedModelError(
            f"model type {mtype!r} failed {step} ({type(exc).__name__}: {short_message(exc)}); "
            "the engine cannot run it"
        ) from exc


def short_message(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


@torch.no_grad()
def _probe_forward(model: PreTrainedModel, mtype: str, *, again: bool) -> None:
    """One watched forward (`observe_forward`): a block run more than once per forward is a looped transformer,
    and a dropout that draws masks breaks the contract; with `again`, the same tokens run a second time must
    give the same logits (tree replay scores a prefix once and replays branches later, exact only when
    nothing random happens in between). The random state is restored, so probing does not change what
    training samples."""
    param = next(model.parameters())
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(1)).to(param.device)
    pos = torch.arange(12, device=param.device)[None]
    devices = [param.device.index or 0] if param.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        seen = observe_forward(model, ids, pos)
        if seen.looped is not None:
            block, runs = seen.looped
            raise UnsupportedModelError(
                f"model type {mtype!r} runs decoder block {block} {runs} times in one forward (a looped "
                "transformer), and resident KV is one entry per layer"
            )
        if seen.dropout is not None:
            raise UnsupportedModelError(
                f"model type {mtype!r} has active dropout ({seen.dropout}) in {_DROPOUT_FIX}"
            )
        if not again:
            return
        a = seen.logits  # [1, 12, V]
        b = model(input_ids=ids, position_ids=pos, use_cache=False).logits  # [1, 12, V]
    diff = ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1.0)).item()
    tol = 1e-3 if a.dtype in (torch.float16, torch.bfloat16) else 1e-5  # kernels may reorder sums
    if not diff <= tol:
        mode = "train" if training(model) else "eval"
        fields = ", ".join(f"config.{k}={v:g}" for k, v in dropout_fields(unwrap(model)).items())
        if fields and mode == "train":  # the likely cause: functional dropout reading one of them
            raise UnsupportedModelError(
                f"model type {mtype!r} has active dropout ({fields}; the same tokens twice give different "
                f"outputs, relative difference {diff:.2e}) in {_DROPOUT_FIX}"
            )
        raise UnsupportedModelError(
            f"model type {mtype!r} gives different outputs for the same tokens twice in {mode} mode (relative "
            f"difference {diff:.2e}): something random is active, such as dropout called as a function; a "
            "replayed branch would see other randomness than its scoring pass. Set every dropout to 0, or call "
            "model.eval()"
        )


_DROPOUT_FIX = (
    "train mode; a replayed branch would see different masks than its scoring pass. Set dropout to 0 for RL "
    "training, or call model.eval()"
)


@torch.no_grad()
def _probe(
    model: PreTrainedModel,
    mtype: str,
    *,
    length: int = 12,
    split: int = 5,
    window: int | None = None,
    local: str = "a sliding window",
) -> None:
    """Compare a whole forward with the same tokens split in two, and head-only logprobs with the model's own;
    both must agree to the dtype's precision. `window` is the window (or, with `local="attention chunks"`, the
    attention chunk) the split crosses."""
    param = next(model.parameters())
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, length), generator=gen).to(param.device)
    pos = torch.arange(length, device=param.device)[None]
    with evaluating(model):
        whole = decoder_forward(model, ids, pos, None).hidden
        first = decoder_forward(model, ids[:, :split], pos[:, :split], None)
        _check_cache_count(model, mtype, len(first.keys) - len(first.recurrent))
        past = first.entries()
        second = continue_pieces(model, ids, pos, split, length, [past]).hidden
        tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3}.get(whole.dtype, 1e-5)
        shared_err = split_error(whole, first.hidden, second)
        if shared_past_reason(unwrap(model)) is None and not shared_err <= tol:
            # Tell a layer that attends over other tensors than it caches (DiffLlama splits its cached values)
            # from a past the model cannot continue at all: the layer's own attention over the concatenated past.
            again = continue_pieces(model, ids, pos, split, length, [past], concatenate=True).hidden
            windowed = active_window(model, length)
            chunked = active_chunk(model, length)
            if split_error(whole, first.hidden, again) <= tol and (
                windowed is not None or chunked is not None
            ):
                what = (
                    f"a sliding window of {windowed}"
                    if windowed is not None
                    else f"attention chunks of {chunked}"
                )
                raise UnsupportedModelError(
                    f"model type {mtype!r} uses {what} tokens, and shared-past attention over resident KV changes "
                    f"the hidden states across it (relative error {shared_err:.2e}) where the layer's own attention "
                    "over the concatenated past does not: it is not reproduced over resident KV for this model "
                    "(use sequences no longer than it)"
                )
            if split_error(whole, first.hidden, again) <= tol:
                raise UnsupportedModelError(
                    f"model type {mtype!r}: shared-past attention over resident KV changes the hidden states "
                    f"(relative error {shared_err:.2e}) where the layer's own attention over the concatenated past "
                    "does not: its layers attend over other tensors than they cache (as DiffLlama's split values), "
                    "which shared-past attention does not reproduce"
                )
        head_err = None
        chain_err = recompute_error(model, ids, pos, split, whole) if window is None else 0.0
        if window is None:  # the head check needs `[1, length, V]` logits: only on the short probe
            reference = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float().log_softmax(-1)
            from_head = output_head(model)(whole).float().log_softmax(-1)
            head_err = (from_head - reference).abs().max().item()
    scale = whole.abs().max().clamp_min(1.0)
    prefix_err = ((first.hidden - whole[:, :split]).abs().max() / scale).item()
    if not prefix_err <= tol:
        raise UnsupportedModelError(
            f"model type {mtype!r}: a prefix evaluated alone gives other hidden states than inside the whole "
            f"sequence (relative error {prefix_err:.2e}), so its positions see later tokens (attention is not "
            "causal); a shared prefix evaluated once cannot stand for it"
        )
    err = split_error(whole, first.hidden, second)
    if not err <= tol and window is not None:
        raise UnsupportedModelError(
            f"model type {mtype!r} uses {local} of {window} tokens, and continuing from stored KV across it "
            f"changes the hidden states (relative error {err:.2e}); it is not reproduced across resident KV for "
            "this model (use sequences no longer than it)"
        )
    if not err <= tol:
        raise UnsupportedModelError(
            f"model type {mtype!r}: continuing from stored KV changes the hidden states (relative error {err:.2e}); "
            "its cache carries state the engine does not reproduce"
        )
    if not chain_err <= tol:
        raise UnsupportedModelError(
            f"model type {mtype!r}: a span recomputed from stored state and continued changes the hidden states "
            f"(relative error {chain_err:.2e}) where one continuation does not; the engine recomputes units this way "
            "(ratio_source='sampler', a retention budget) and would train on wrong state"
        )
    head_tol = 1e-2 if whole.dtype in (torch.float16, torch.bfloat16) else 1e-4
    if head_err is not None and not head_err <= head_tol:
        raise UnsupportedModelError(
            f"model type {mtype!r}: the model changes its logits after the LM head (logprob difference "
            f"{head_err:.2e}) in a way the engine's head does not reproduce (it applies `logit_scale`, "
            "`logits_scaling` and `final_logit_softcapping`)"
        )


def _check_cache_count(model: PreTrainedModel, mtype: str, caches: int) -> None:
    """One KV cache per attention layer that keeps its own (each has a distinct `layer_idx`; a layer that
    reuses an earlier layer's KV, Gemma 3n/4's `num_kv_shared_layers`, keeps none), else a refusal that says
    what the model does instead."""
    n_blocks = len(decoder_layers(model))
    unkeyed = unkeyed_layers(unwrap(model))  # recurrent state or none, not a KV cache
    if caches == 0 and not unkeyed:
        raise UnsupportedModelError(
            f"model type {mtype!r} returns no KV cache from its forward, so a prefix cannot be continued from "
            "resident KV"
        )
    indices = cache_layer_indices(model)
    reusing = sum(1 for m in model.modules() if getattr(m, "is_kv_shared_layer", False) is True)
    own = (len(indices - unkeyed) if indices else n_blocks - len(unkeyed)) - reusing
    if caches > own:
        raise UnsupportedModelError(
            f"model type {mtype!r} keeps {caches} KV caches for {own} attention layers ({n_blocks} blocks): it runs "
            "layers more than once per forward (a looped transformer), and resident KV is one entry per layer"
        )
    if caches < own:
        raise UnsupportedModelError(
            f"model type {mtype!r} keeps {caches} KV caches for {own} attention layers that compute their own keys: "
            "some layers reuse another layer's KV in a way the engine does not map"
        )


class SupportGate:
    """Runs `check_supported` once per model, and again only for a batch longer than any checked so far.

    The checks depend on the sequence length (a sliding window), so a later, longer batch is checked again:
    the general probe runs the first time, the window probe the first time sequences run past the window.
    """

    def __init__(self, *, trusting: bool = False) -> None:
        self._checked: dict[int, int] = {}
        self.trusting = trusting
        """Check nothing: for callers that run a model already checked (calibration, benchmarks)."""

    def require(self, model: PreTrainedModel, max_sequence_length: int) -> None:
        if self.trusting:
            return
        key = id(model)
        before = self._checked.get(key)
        if before is not None and before >= max_sequence_length:
            return
        window_before = before is not None and active_window(model, before) is not None
        check_supported(
            model, max_sequence_length, probe=before is None, probe_window=not window_before
        )  # fmt: skip
        self._checked[key] = max_sequence_length
