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
exception inside a probe becomes an `UnsupportedModelError` naming the model type and the step. The probes
are `treetrain.models.support_probes`; this module reads the configuration and runs them.

Example:
    >>> check_supported(model, max_sequence_length=4096)        # doctest: +SKIP
    >>> gate = SupportGate()                                      # doctest: +SKIP
    >>> gate.require(model, 4096); gate.require(model, 512)       # the second call does nothing  # doctest: +SKIP
"""

from __future__ import annotations

from transformers import PreTrainedModel

from treetrain.models.decoder import decoder_layers
from treetrain.models.foreign_state import forward_state_reason, module_state_reason, state_argument
from treetrain.models.indexer_state import other_indexer_reason
from treetrain.models.lora import unwrap
from treetrain.models.module_modes import training
from treetrain.models.recurrent_state import (
    HYBRID_LAYER_TYPES,
    RECURRENT_LAYER_TYPES,
    STATELESS_LAYER_TYPES,
    argument_state_mixers,
    recurrent_layers,
    unsupported_mixer,
)
from treetrain.models.support_probes import (
    CHUNKED_TYPES,
    SLIDING_TYPES,
    UnsupportedModelError,
    active_chunk,
    active_window,
    guarded,
    probe_forward,
    probe_split,
)

#: Layer types whose state is plain KV over every earlier position.
FULL_ATTENTION_TYPES = frozenset({"full_attention"})
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
            guarded(mtype, "the first forward", lambda: probe_forward(model, mtype, again=probe))
            if probe:
                guarded(mtype, "the split probe", lambda: probe_split(model, mtype))
        except UnsupportedModelError:
            held = module_state_reason(unwrap(model))
            if held is None:
                raise
            raise UnsupportedModelError(f"model type {mtype!r} {held}") from None
    window = active_window(model, max_sequence_length)
    if window is not None and (probe if probe_window is None else probe_window):
        # The split lands inside the window and the sequence runs past it, so a mask that mishandled the
        # resident past (keys the window should drop, or positions it should keep) shows up.
        guarded(
            mtype,
            "the sliding-window probe",
            lambda: probe_split(model, mtype, length=2 * window + 2, split=window // 2 + 1, window=window),
        )
    chunk = active_chunk(model, max_sequence_length)
    if chunk is not None and (probe if probe_window is None else probe_window):
        # Likewise across a chunk boundary: the split lands inside the first chunk, the second runs past it.
        guarded(
            mtype,
            "the chunk probe",
            lambda: probe_split(
                model,
                mtype,
                length=2 * chunk + 2,
                split=chunk // 2 + 1,
                window=chunk,
                local="attention chunks",
            ),
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
