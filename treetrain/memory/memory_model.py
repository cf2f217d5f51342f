"""What a calibration knows: bytes per shape feature, fitted on the model, and the features of a shape.

`treetrain.memory.calibrate` measures probes and fits a `MemoryModel`; the ledger and the planner ask it
what a forward, a replay step or a no-grad pass of a given `Shape` costs; `treetrain.memory.calibration_store`
keeps it on disk. The features and why each is there are in `treetrain.memory.calibrate`'s docstring.

Example:
    >>> from treetrain.memory.fit import Affine, MaxAffine
    >>> flat = Affine((0.0,) * 8 + (1000.0,))               # a constant 1000 bytes with a past
    >>> regime = RegimeModel(flat, flat, MaxAffine(Affine((0.0,) * 4), Affine((0.0,) * 12)), MaxAffine(flat, flat))
    >>> mm = MemoryModel("k", "exact", 64, 32, regime, regime, 1, 0.0)
    >>> mm.forward_peak(Shape(rows=2, width=4, past=8, pieces=1, targets=8))
    1000
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treetrain.memory.events import Shape
from treetrain.memory.fit import Affine, MaxAffine
from treetrain.memory.recurrent_cost import row_chunks
from treetrain.replay.schedule import Contract


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
            [k * w, k * (p + w), k * w * (p + w), p, p * (s.pieces >= 2), s.stored, rows, chunks, 1.0]
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
