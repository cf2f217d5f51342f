"""Activation bytes calibrated on the actual model and dtype: what a forward of a given shape costs.

Nothing here comes from a paper formula. `calibrate(model, contract)` runs the real engine on a fixed set
of probe trees with a `MemoryTracker` attached, pairs every scoring batch and replay step with its
shape (`treetrain.memory.events`), and fits how many bytes each shape feature costs. Most probes are
small and vary the shape (K, depth, shared tokens); a few are long (up to `LONG_PROBE` tokens,
`treetrain.memory.calibration_probes.long_probes`), so that the per-token costs are measured where they
dominate: a whole 8192-token sequence is then predicted from 1024-token ones, not from 160-token ones. The
features:

- per token (`rows x width`): hidden states, MLP activations, norms;
- per row and context token (`rows x (past + width)`): the key/value cache a batch attends over, its
  grouped-query copies, and in `exact` mode the gradient buffers of a <KV, G> term;
- per token and context token (`rows x width x (past + width)`): attention masks, and with eager
  attention the attention weights (the root batch, without a past, has its own causal form);
- per logits row (`min(targets, chunk rows)`): the head's logits, recomputed chunk by chunk in backward;
- per row and sequence chunk of a recurrent layer (`rows x ceil(width / C)`): the chunked kernels'
  per-chunk intermediates, a step function of the width (`treetrain.memory.recurrent_cost`; zero for a
  model without recurrent layers);
- per past token, whatever the rows: multi-head latent attention expands each piece of the past to full
  keys and values once per layer of a step and keeps them for the backward (it fits to about zero for
  other attention);
- per past token gathered from several units, per path token receiving a KV gradient, per new G token,
  per stored KV token.

Bytes alive at any instant are linear in these features, so every fit is a least-squares fit with
non-negative costs per feature (`treetrain.memory.fit`); that keeps collinear probes from trading large
costs of opposite sign, which would not extrapolate to longer sequences. A backward's peak is a maximum
over instants (the head's logits early, a layer's attention gradients later), so it is fitted as the max of
two affine pieces (early: the head's logits and the largest weight gradient, alive for an instant; late: a
per-token term). New KV-gradient accumulators G are allocated before a step's forward; their bytes are
known exactly (tokens x KV bytes per token), so they are taken out of the measured samples and the ledger
books them as resident state. There are two regimes, with and without a past, and per regime four fits: the graph
alive when backward starts (`graph`, also what a kept graph holds), the forward's peak, the backward's
peak above the graph, and a no-grad forward's peak.

The probes and their measurement are `treetrain.memory.calibration_probes`; this module fits and predicts.
Calibrations are cached per (model config, trainable parameters, dtype, attention implementation, device,
contract, entropy, logits chunk, probes, library versions and treetrain's code), in this
process and on disk for later ones (`treetrain.memory.calibration_store`).

Example:
    >>> model = tiny_model("llama", 64)                                          # doctest: +SKIP
    >>> cal = calibrate(model, "exact")                                          # doctest: +SKIP
    >>> cal.step_peak(Shape(rows=4, width=17, past=63, pieces=1, targets=64))    # doctest: +SKIP
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import transformers
from transformers import PreTrainedModel

from treetrain.memory import calibration_store
from treetrain.memory.calibration_probes import Probe, StepSample, head_grad_bytes, measure
from treetrain.memory.events import Shape
from treetrain.memory.fit import fit_affine, fit_max_affine
from treetrain.memory.memory_model import (
    MemoryModel,
    RegimeModel,
    backward_features,
    body_features,
    nograd_head_features,
    step_head_features,
)
from treetrain.memory.persistent import kv_bytes_per_token, state_bytes_per_unit
from treetrain.memory.recurrent_cost import recurrent_chunk
from treetrain.models.logprobs import DEFAULT_MAX_LOGIT_ELEMENTS
from treetrain.replay.schedule import Contract

CALIBRATION_VERSION = 3


def _fit_regime(
    steps: list[StepSample], nograd: list[tuple[Shape, int]], logit_rows: int, pieces: int, chunk: int | None
) -> tuple[RegimeModel, float]:
    """Fit one regime; `pieces=1` makes the backward peak a single affine function."""
    body = np.array([body_features(s.shape, logit_rows, chunk) for s in steps]).reshape(len(steps), -1)
    head = np.array([step_head_features(s.shape, logit_rows) for s in steps]).reshape(len(steps), -1)
    fwd = np.array([s.forward for s in steps], dtype=float)
    graph_y = np.array([s.graph for s in steps], dtype=float)
    bwd = np.array([s.backward for s in steps], dtype=float)
    graph = fit_affine(body, graph_y, nonneg=True)
    forward = fit_affine(body, fwd, nonneg=True)
    graph_pred = body @ np.array(graph.coef) if len(steps) else np.zeros(0)
    back = np.array([backward_features(s.shape, logit_rows, chunk) for s in steps]).reshape(len(steps), -1)
    backward = fit_max_affine(head, back, bwd - graph_pred, nonneg=True, restarts=16 if pieces == 2 else 0)
    nb = np.array([body_features(s, logit_rows, chunk) for s, _ in nograd]).reshape(len(nograd), -1)
    nh = np.array([nograd_head_features(s, logit_rows) for s, _ in nograd]).reshape(len(nograd), -1)
    ny = np.array([y for _, y in nograd], dtype=float)
    no = fit_max_affine(nh, nb, ny, nonneg=True, restarts=0)
    model = RegimeModel(graph, forward, backward, no)
    errs = [0.0]
    for s in steps:
        b = body_features(s.shape, logit_rows, chunk)
        bb = backward_features(s.shape, logit_rows, chunk)
        pred = max(forward(b), graph(b) + backward.predict(step_head_features(s.shape, logit_rows), bb))
        errs.append(abs(pred - max(s.forward, s.backward)) / max(s.forward, s.backward, 1))
    for shape, y in nograd:
        pred = no.predict(nograd_head_features(shape, logit_rows), body_features(shape, logit_rows, chunk))
        errs.append(abs(pred - y) / max(y, 1))
    return model, max(errs)


_CACHE: dict[str, MemoryModel] = {}


def calibration_key(
    model: PreTrainedModel,
    contract: str,
    with_entropy: bool,
    max_logit_elements: int,
    probes: tuple[Probe, ...] | None = None,
) -> str:
    p = next(model.parameters())
    config = model.config.get_text_config(decoder=True)
    attn = str(getattr(config, "_attn_implementation", "eager"))
    # which parameters train is part of the key: a frozen weight saves no input for its gradient, so the
    # same configuration with adapters or frozen layers has other activation bytes
    trains = "".join(
        f"{n}{tuple(getattr(q, 'ds_shape', q.shape))}{q.requires_grad}" for n, q in model.named_parameters()
    )
    # the versions and the code set what is measured (ZeRO-3 does not: the ledger books fetched parameters
    # apart, so a partitioned model and its unpartitioned twin share one calibration)
    versions = f"{torch.__version__}|{transformers.__version__}|{calibration_store.code_digest()}"
    if p.device.type == "cuda":  # kernels, and so their scratch tensors, are chosen per GPU
        versions += f"|{torch.cuda.get_device_name(p.device)}"
    text = f"{CALIBRATION_VERSION}|{model.config.to_json_string()}|{p.dtype}|{attn}|{p.device.type}|{contract}|{with_entropy}|{max_logit_elements}|{probes!r}|{trains}|{versions}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibrate(
    model: PreTrainedModel,
    contract: Contract,
    *,
    with_entropy: bool = False,
    max_logit_elements: int = DEFAULT_MAX_LOGIT_ELEMENTS,
    cache: bool = True,
    probes: tuple[Probe, ...] | None = None,
) -> MemoryModel:
    """Measure and fit `model`'s activation bytes (see module docstring); cached per configuration.

    `probes` replaces the default set (`probes_for(model)`), e.g. to see what short probes alone predict."""
    key = calibration_key(model, contract, with_entropy, max_logit_elements, probes)
    if cache:
        kept = _CACHE.get(key) or _usable(calibration_store.load(key))
        if kept is not None:
            _CACHE[key] = kept
            return kept
    steps, nograd = measure(
        model, contract, with_entropy=with_entropy, max_logit_elements=max_logit_elements, probes=probes
    )
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    logit_rows = max(1, max_logit_elements // vocab)
    chunk = recurrent_chunk(model)
    past, e1 = _fit_regime(
        [s for s in steps if s.shape.past > 0], [n for n in nograd if n[0].past > 0], logit_rows, 2, chunk
    )
    root, e2 = _fit_regime(
        [s for s in steps if s.shape.past == 0], [n for n in nograd if n[0].past == 0], logit_rows, 2, chunk
    )
    out = MemoryModel(
        key,
        contract,
        kv_bytes_per_token(model),
        logit_rows,
        past,
        root,
        len(steps) + len(nograd),
        max(e1, e2),
        head_grad_bytes(model),
        state_bytes_per_unit(model),
        chunk,
    )
    if cache:
        _CACHE[key] = out
        calibration_store.save(out)
    return out


def _usable(kept: MemoryModel | None) -> MemoryModel | None:
    """`kept` if it predicts (its fitted costs have the lengths this code's features have), else None."""
    if kept is None:
        return None
    try:
        for past in (0, 8):
            shape = Shape(rows=2, width=4, past=past, pieces=1, targets=8)
            kept.step_peak(shape), kept.nograd_peak(shape), kept.graph_bytes(shape)
    except ValueError:
        return None
    return kept
