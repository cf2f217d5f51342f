"""The support check's behavioural probes: what the model does, beside what its configuration says.

`treetrain.models.support.check_supported` reads the configuration and the modules first, then runs these
probes, because names miss things and config fields mislead: one watched forward (`probe_forward`: looped
blocks, dropout that runs, the same tokens twice), and the split probe (`probe_split`: a sequence run whole
against the same tokens split in two and continued from stored KV, head-only logprobs against the model's
own, a recomputed span, and across a sliding window or attention chunk when the sequences run past one).
Each refusal is an `UnsupportedModelError` naming the model type and what it does; `guarded` turns any
other exception inside a probe into one naming the step.

Example:
    >>> from treetrain.models.presets import tiny_model
    >>> probe_split(tiny_model("llama", 64), "llama")  # agrees: returns without a refusal
    >>> active_window(tiny_model("mistral", 64), 4096) is not None
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from treetrain.errors import TreetrainError
from treetrain.models.attention import shared_past_reason
from treetrain.models.continuation import continue_pieces, recompute_error, split_error
from treetrain.models.decoder import cache_layer_indices, decoder_forward, decoder_layers, output_head
from treetrain.models.lora import unwrap
from treetrain.models.module_modes import evaluating, training
from treetrain.models.observed_forward import dropout_fields, observe_forward
from treetrain.models.recurrent_state import unkeyed_layers

#: Layer types with a sliding window (a hybrid layer's attention may have one: `hybrid_sliding`).
SLIDING_TYPES = frozenset({"sliding_attention", "hybrid_sliding"})
#: Layer types of chunked attention (Llama 4): a query sees the earlier keys of its own fixed-size chunk,
#: which shared-past attention builds from absolute positions (`treetrain.models.attention.layer_chunk`).
CHUNKED_TYPES = frozenset({"chunked_attention"})


class UnsupportedModelError(TreetrainError, ValueError):
    """The engine cannot reproduce this model's computation across a tree split; the message says why."""


def _sliding_window(config: object) -> int | None:
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


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


def guarded(mtype: str, step: str, run: Callable[[], None]) -> None:
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
def probe_forward(model: PreTrainedModel, mtype: str, *, again: bool) -> None:
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
def probe_split(
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
        check_cache_count(model, mtype, len(first.keys) - len(first.recurrent))
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


def check_cache_count(model: PreTrainedModel, mtype: str, caches: int) -> None:
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
