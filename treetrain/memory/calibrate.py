"""Activation bytes calibrated on the actual model and dtype: what a forward of a given shape costs.

Nothing here comes from a paper formula. `calibrate(model, contract)` runs the real engine on a fixed set
of probe trees with a `MemoryTracker` attached, pairs every scoring batch and replay step with its
shape (`treetrain.memory.events`), and fits how many bytes each shape feature costs. Most probes are
small and vary the shape (K, depth, shared tokens); a few are long (up to `LONG_PROBE` tokens, see
`long_probes`), so that the per-token costs are measured where they dominate: a whole 8192-token
sequence is then predicted from 1024-token ones, not from 160-token ones. The features:

- per token (`rows x width`): hidden states, MLP activations, norms;
- per row and context token (`rows x (past + width)`): the key/value cache a batch attends over, its
  grouped-query copies, and in `exact` mode the gradient buffers of a <KV, G> term;
- per token and context token (`rows x width x (past + width)`): attention masks, and with eager
  attention the attention weights (the root batch, without a past, has its own causal form);
- per logits row (`min(targets, chunk rows)`): the head's logits, recomputed chunk by chunk in backward;
- per row and sequence chunk of a recurrent layer (`rows x ceil(width / C)`): the chunked kernels'
  per-chunk intermediates, a step function of the width (`treetrain.memory.recurrent_cost`; zero for a
  model without recurrent layers);
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

Calibrations are cached per (model config, dtype, attention implementation, device, contract, entropy,
logits chunk, probes), in this process.

Example:
    >>> model = tiny_model("llama", 64)                                          # doctest: +SKIP
    >>> cal = calibrate(model, "exact")                                          # doctest: +SKIP
    >>> cal.step_peak(Shape(rows=4, width=17, past=63, pieces=1, targets=64))    # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.events import Shape, plan_tree
from treetrain.memory.fit import Affine, MaxAffine, fit_affine, fit_max_affine
from treetrain.memory.persistent import kv_bytes_per_token, state_bytes_per_unit
from treetrain.memory.recurrent_cost import recurrent_chunk, row_chunks
from treetrain.memory.tracker import MeasuredSegment, MemoryTracker
from treetrain.models.logprobs import DEFAULT_MAX_LOGIT_ELEMENTS
from treetrain.models.support import SupportGate
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.schedule import Contract
from treetrain.replay.tree_replay import TreeReplay
from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree.build import build_tree
from treetrain.tree.trajectory_tree import TrajectoryTree

CALIBRATION_VERSION = 3


@dataclass(frozen=True)
class Probe:
    """One probe tree: a `prompt` (and `shared` policy tokens), then `fans[i]` branches per level of
    `turn` tokens each, replayed with K = `microbatch` (0: all siblings) and units of `chunk` tokens."""

    prompt: int
    shared: int
    fans: tuple[int, ...]
    turn: int
    microbatch: int
    chunk: int | None = None


#: Short probes: many shapes (K, depth, shared tokens), each cheap.
PROBES: tuple[Probe, ...] = (
    Probe(10, 0, (2,), 6, 0),
    Probe(24, 3, (3,), 9, 0),
    Probe(20, 4, (1,), 14, 0),
    Probe(64, 0, (3,), 20, 0),
    Probe(40, 0, (4,), 4, 2),
    Probe(12, 0, (3, 2), 10, 0),
    Probe(40, 0, (4, 2), 6, 0),
    Probe(26, 0, (4, 2), 12, 3),
    Probe(48, 2, (2, 2), 4, 0),
    Probe(5, 2, (2, 2, 2), 5, 3),
    Probe(160, 0, (2,), 4, 0),
    Probe(100, 3, (2,), 5, 1),
)

LONG_PROBE = 1024
"""Tokens of the longest probe sequence (capped by the model's position limit)."""


def long_probes(length: int) -> tuple[Probe, ...]:
    """Probes at `length` and `length // 2` tokens, so per-token costs are measured, not extrapolated.

    Short probes alone cannot tell a per-token cost from a per-token-squared one or from a constant (the
    largest weight's gradient, alive for an instant in backward, is as large as a 100-token graph), and
    flat's whole sequences are many times longer. Two whole sequences without a past pin the no-past
    regime's slope; a chunked prompt with two short branches gives the past regime long pasts and wide
    chunks. Each is one forward and backward of at most `length` tokens.

    Example:
        >>> [p.prompt + p.turn for p in long_probes(1024)]
        [1024, 512, 256, 1024]
    """
    half, quarter = length // 2, length // 4
    return (
        Probe(length - 64, 0, (1,), 64, 0),
        Probe(half - 16, 0, (1,), 16, 0),
        Probe(quarter - 48, 0, (1,), 48, 0),
        Probe(length - 16, 0, (2,), 16, 2, chunk=quarter),
    )


def probes_for(model: PreTrainedModel) -> tuple[Probe, ...]:
    """The short probes and the long ones that fit `model`'s position limit."""
    config = model.config.get_text_config(decoder=True)
    limit = int(getattr(config, "max_position_embeddings", None) or LONG_PROBE)
    length = min(LONG_PROBE, limit)
    return PROBES + (long_probes(length) if length >= 256 else ())


@dataclass(frozen=True)
class RegimeModel:
    """Fitted byte costs for forwards with (or without) a past."""

    graph: Affine
    """Bytes the graph holds when backward starts."""
    forward: Affine
    """Peak bytes during a forward under autograd."""
    backward: MaxAffine
    """Peak bytes during backward, above the graph."""
    nograd: MaxAffine
    """Peak bytes of a no-grad forward (scoring, reference scoring, recompute)."""


@dataclass(frozen=True)
class MemoryModel:
    """Calibrated activation bytes of one model, dtype, attention implementation and contract."""

    key: str
    contract: Contract
    kv_bytes_per_token: int
    """Resident KV bytes of one token."""
    logit_rows: int
    """Rows of one logits chunk (`max_logit_elements // vocab`)."""
    past: RegimeModel
    root: RegimeModel
    samples: int
    """Measured forwards the fits rest on."""
    fit_error: float
    """Largest relative error of the fitted peaks on the probes themselves."""
    head_grad_bytes: int = 0
    """Bytes of the output head's weight gradient. With more targets than one logits chunk holds, the
    chunks' weight gradients are summed in backward, so one more of them is alive (`multi_chunk_bytes`)."""

    state_bytes_per_unit: int = 0
    """Resident recurrent-state bytes of one unit, whatever its length (linear-attention layers)."""
    recurrent_chunk: int | None = None
    """Sequence chunk of the recurrent layers' kernels (0: a scan without chunks; None: no such layers)."""

    def multi_chunk_bytes(self, shape: Shape) -> int:
        """Exact bytes a backward adds when `shape`'s targets span several logits chunks."""
        return self.head_grad_bytes if shape.targets > self.logit_rows else 0

    def _regime(self, shape: Shape) -> RegimeModel:
        return self.past if shape.past > 0 else self.root

    def _body(self, shape: Shape) -> np.ndarray:
        return body_features(shape, self.logit_rows, self.recurrent_chunk)

    def _back(self, shape: Shape) -> np.ndarray:
        return backward_features(shape, self.logit_rows, self.recurrent_chunk)

    def graph_bytes(self, shape: Shape) -> int:
        """Bytes a forward's graph holds until its backward (a kept graph holds this long)."""
        if shape.rows == 0:
            return 0
        return max(0, round(self._regime(shape).graph(self._body(shape))))

    def forward_peak(self, shape: Shape) -> int:
        if shape.rows == 0:
            return 0
        return max(0, round(self._regime(shape).forward(self._body(shape))))

    def step_peak(self, shape: Shape) -> int:
        """Peak bytes of a replay step above what was live before it (forward, then backward)."""
        if shape.rows == 0:
            return 0
        r = self._regime(shape)
        body = self._body(shape)
        extra = r.backward.predict(step_head_features(shape, self.logit_rows), self._back(shape))
        extra += self.multi_chunk_bytes(shape)
        return max(0, round(max(r.forward(body), r.graph(body) + extra)))

    def backward_extra(self, shape: Shape) -> int:
        """Bytes a backward adds above the graph it runs through (a kept graph's step)."""
        if shape.rows == 0:
            return 0
        r = self._regime(shape)
        head = step_head_features(shape, self.logit_rows)
        extra = r.backward.predict(head, self._back(shape))
        return max(0, round(extra + self.multi_chunk_bytes(shape)))

    def nograd_peak(self, shape: Shape) -> int:
        r = self._regime(shape)
        body = self._body(shape)
        return max(0, round(r.nograd.predict(nograd_head_features(shape, self.logit_rows), body)))


def body_features(s: Shape, logit_rows: int, chunk: int | None = None) -> np.ndarray:
    """Features of a forward's graph and peaks (the terms a backward adds are in `backward_features`);
    `chunk` is the recurrent layers' (`MemoryModel.recurrent_chunk`)."""
    k, w, p = s.rows, s.width, s.past
    rows = min(s.targets, logit_rows)
    chunks = row_chunks(k, w, chunk)
    if p > 0:
        return np.array(
            [k * w, k * (p + w), k * w * (p + w), p * (s.pieces >= 2), s.stored, rows, chunks, 1.0]
        )
    return np.array([k * w, k * w * w, s.stored, rows, chunks, 1.0])


def backward_features(s: Shape, logit_rows: int, chunk: int | None = None) -> np.ndarray:
    """`body_features` plus the backward's own terms: <KV, G> buffers, path gradients, new G."""
    g = 1.0 if s.kv_grad else 0.0
    extra = [g * s.rows * (s.past + s.width), s.path_tokens, s.new_grad_tokens]
    body = body_features(s, logit_rows, chunk)  # the constant stays last: the one coefficient of either sign
    return np.concatenate([body[:-1], np.array(extra, dtype=float), body[-1:]])


def step_head_features(s: Shape, logit_rows: int) -> np.ndarray:
    """The early-backward instant: the head's logits, <KV, G> buffers, a per-token term and a constant
    (the largest weight's gradient, alive for an instant before it is accumulated)."""
    g = 1.0 if s.kv_grad else 0.0
    return np.array(
        [min(s.targets, logit_rows), g * s.rows * (s.past + s.width), s.rows * s.width, 1.0], dtype=float
    )


def nograd_head_features(s: Shape, logit_rows: int) -> np.ndarray:
    return np.array([min(s.targets, logit_rows), s.stored, 1.0], dtype=float)


# ----- probes ---------------------------------------------------------------------------------------------
def probe_tree(
    prompt: int, shared: int, fans: tuple[int, ...], turn: int, vocab: int, seed: int
) -> TrajectoryTree:
    """Trajectories sharing a prompt (and `shared` policy tokens), then branching `fans[i]` ways per level."""
    rng = random.Random(seed)
    high = max(2, min(vocab, 1000))

    def seg(role: Role, n: int) -> Segment:
        toks = tuple(rng.randrange(1, high) for _ in range(n))
        return Segment(role, toks, tuple(-1.0 for _ in toks) if role is Role.POLICY else None)

    head = [seg(Role.PROMPT, prompt)] + ([seg(Role.POLICY, shared)] if shared else [])
    paths = [head]
    for level, fan in enumerate(fans):
        grown = []
        for p in paths:
            for _ in range(fan):
                more = [seg(Role.POLICY, turn)]
                if level < len(fans) - 1:
                    more.append(seg(Role.OBSERVATION, max(1, turn // 3)))
                grown.append(p + more)
        paths = grown
    trajs = [Trajectory(f"probe{seed}-{i}", (Call(tuple(p)),), float(i % 2)) for i, p in enumerate(paths)]
    return build_tree(trajs)


@dataclass(frozen=True)
class StepSample:
    shape: Shape
    forward: int
    graph: int
    backward: int


def _segments(tracker: MemoryTracker) -> dict[str, MeasuredSegment]:
    return {s.label: s for s in tracker.segments}


def measure(
    model: PreTrainedModel,
    contract: Contract,
    *,
    with_entropy: bool,
    max_logit_elements: int,
    probes: tuple[Probe, ...] | None = None,
) -> tuple[list[StepSample], list[tuple[Shape, int]]]:
    """Run the probes (default `probes_for(model)`); return measured steps and no-grad batches.

    Parameter `.grad`s are restored. Memory does not depend on parameter values, so the probes run on
    the model as it is."""
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    per_token = kv_bytes_per_token(model)
    logit_rows, head_grad = max(1, max_logit_elements // vocab), head_grad_bytes(model)
    loss = LossConfig(entropy_coef=0.01 if with_entropy else 0.0)
    saved = [p.grad for p in model.parameters()]
    steps: list[StepSample] = []
    nograd: list[tuple[Shape, int]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # probes are tiny: more threads cost more than they give
    try:
        name = str(getattr(model.config, "model_type", "model"))
        chosen = probes_for(model) if probes is None else probes
        hidden = os.environ.get("TQDM_DISABLE", "") not in ("", "0")  # `--no-progress`: no bars at all
        shown = tqdm(
            chosen,
            desc=f"calibrating {name} memory ({contract})",
            leave=False,
            disable=True if hidden else None,
        )
        for seed, probe in enumerate(shown):
            for p in model.parameters():  # the ledger books gradients from the window's start
                # (not a ZeRO-3 parameter: it is partitioned here, its gradient has the full shape)
                partitioned = getattr(p, "ds_numel", p.numel()) != p.numel()
                p.grad = torch.zeros_like(p) if p.requires_grad and not partitioned else None
            tree = probe_tree(probe.prompt, probe.shared, probe.fans, probe.turn, vocab, seed)
            adv = compute_advantages([tree], AdvantageConfig(zero_variance="keep"))
            batch = UpdateBatch.build([tree], adv.trees, loss)
            cfg = ReplayConfig(
                contract=contract,
                microbatch=probe.microbatch,
                chunk_size=probe.chunk,
                skip_inert=False,
                max_logit_elements=max_logit_elements,
            )
            tracker = MemoryTracker(next(model.parameters()).device)
            engine = TreeReplay(
                model, loss, cfg, support=SupportGate(trusting=True), hooks=ReplayHooks(tracker=tracker)
            )
            engine.accumulate(batch)
            tracker.detach()
            segs = _segments(tracker)
            plan = plan_tree(
                batch.work[0],
                cfg,
                loss,
                kv_bytes_per_token=per_token,
                state_bytes_per_unit=state_bytes_per_unit(model),
            )
            for ev in plan.events:
                seg = segs.get(ev.label)
                if seg is None:
                    continue
                if ev.kind == "score":
                    nograd.append((ev.shape, seg.peak.total - seg.start.total))
                elif ev.kind == "step" and ev.shape.rows:
                    back = segs[f"{ev.label} backward"]
                    # new G accumulators are allocated before the forward and booked by the ledger
                    # as resident bytes, exactly, so the fits see only the step's own bytes
                    start = seg.start.total + ev.shape.new_grad_tokens * per_token
                    multi = head_grad if ev.shape.targets > logit_rows else 0  # known exactly too
                    steps.append(
                        StepSample(
                            ev.shape,
                            seg.peak.total - start,
                            back.start.total - start,
                            back.peak.total - start - multi,
                        )
                    )
    finally:
        torch.set_num_threads(threads)
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    return steps, nograd


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


def head_grad_bytes(model: PreTrainedModel) -> int:
    """Bytes of the output head weight's gradient (0 when it is frozen, e.g. under LoRA)."""
    head = model.get_output_embeddings()
    w = getattr(head, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.requires_grad:
        return 0
    return int(getattr(w, "ds_numel", w.numel())) * w.element_size()


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
    text = f"{CALIBRATION_VERSION}|{model.config.to_json_string()}|{p.dtype}|{attn}|{p.device.type}|{contract}|{with_entropy}|{max_logit_elements}|{probes!r}|{trains}"
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
    if cache and key in _CACHE:
        return _CACHE[key]
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
    return out
