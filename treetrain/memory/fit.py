"""Least-squares fits for calibrated byte counts: affine, and the maximum of two affine pieces.

At every instant of a forward or backward, the bytes alive are a sum of tensor sizes, each a product of
shape dimensions, so they are *linear* in shape features (tokens, rows x context, ...). A phase's peak is
the largest of those instants, and which instant wins changes with the shape: early in backward the
logits of the head dominate, later a layer's attention gradients. So a peak is modelled as the maximum of
two affine functions (Magnani and Boyd's max-affine regression, fitted by alternating assignment), each
of which is exact within its regime.

Example:
    >>> import numpy as np
    >>> x = np.arange(1.0, 9.0)[:, None]
    >>> y = np.maximum(3 * x[:, 0], 10 + x[:, 0])
    >>> ones = np.ones_like(x)
    >>> m = fit_max_affine(np.hstack([x, ones]), np.hstack([x, ones]), y)
    >>> [round(m.predict(np.array([v, 1.0]), np.array([v, 1.0]))) for v in (2.0, 20.0)]
    [12, 60]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Affine:
    """y = coef . x"""

    coef: tuple[float, ...]

    def __call__(self, x: np.ndarray) -> float:
        return float(np.dot(self.coef, x))


@dataclass(frozen=True)
class MaxAffine:
    """y = max(head . x_head, body . x_body)"""

    head: Affine
    body: Affine

    def predict(self, x_head: np.ndarray, x_body: np.ndarray) -> float:
        return max(self.head(x_head), self.body(x_body))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares, min |a x - b| with x >= 0 (Lawson and Hanson's active-set method)."""
    m, n = a.shape
    tol = 10 * np.finfo(float).eps * float(np.abs(a).sum(axis=0).max(initial=1.0)) * max(m, n)
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ b
    budget = 3 * n + 10
    while (~passive).any() and (w[~passive] > tol).any() and budget > 0:
        budget -= 1
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        z = np.zeros(n)
        z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
        while (z[passive] <= tol).any() and budget > 0:
            budget -= 1
            neg = passive & (z <= tol)
            step = x[neg] - z[neg]
            alpha = float(np.min(np.where(step > 0, x[neg] / np.where(step > 0, step, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
        x = z
        w = a.T @ (b - a @ x)
    return x


def fit_affine(x: np.ndarray, y: np.ndarray, nonneg: bool = False) -> Affine:
    """Least squares with column scaling (features span orders of magnitude).

    With `nonneg`, every coefficient but the last (the constant) is kept >= 0: each feature stands for
    tensors whose bytes it multiplies, so a negative cost is an artefact of collinear probes, and one that
    extrapolates badly.
    """
    if len(y) == 0:
        return Affine(tuple(0.0 for _ in range(x.shape[1])))
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    if nonneg:
        signed = np.hstack([xs, -xs[:, -1:]])  # the constant may take either sign
        raw = nnls(signed, y)
        coef = raw[:-1].copy()
        coef[-1] -= raw[-1]
    else:
        coef, *_ = np.linalg.lstsq(xs, y, rcond=None)
    return Affine(tuple(float(c) for c in coef / scale))


def _max_rel_error(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.max(np.abs(pred - y) / np.maximum(np.abs(y), 1.0))) if len(y) else 0.0


def fit_max_affine(
    x_head: np.ndarray, x_body: np.ndarray, y: np.ndarray, restarts: int = 16, nonneg: bool = False
) -> MaxAffine:
    """The max of two affine pieces with the smallest worst relative error over deterministic restarts.

    Starts put the smallest samples on the head, then seeded random partitions; partitions already
    tried are skipped. The plain affine fit of the body features (head never wins) is the baseline a
    max-affine fit must beat; `restarts=0` returns it.
    """
    n = len(y)
    single = fit_affine(x_body, y, nonneg)
    best = MaxAffine(Affine(tuple(-1e30 if i == 0 else 0.0 for i in range(x_head.shape[1]))), single)
    best_err = _max_rel_error(np.array([best.predict(a, b) for a, b in zip(x_head, x_body)]), y)
    rng = np.random.default_rng(0)
    seen: set[bytes] = set()
    # Starts: the smallest samples on the head (the piece that wins for small shapes), then random.
    starts = [y <= np.quantile(y, q) for q in (0.2, 0.4, 0.6, 0.8)] if n else []
    starts += [rng.random(n) < 0.5 for _ in range(restarts)]
    for on_head in starts if restarts else []:
        for _ in range(20):
            key = np.packbits(on_head).tobytes()
            if key in seen or on_head.sum() < 2 or (~on_head).sum() < 2:
                break
            seen.add(key)
            head = fit_affine(x_head[on_head], y[on_head], nonneg)
            body = fit_affine(x_body[~on_head], y[~on_head], nonneg)
            ph, pb = x_head @ np.array(head.coef), x_body @ np.array(body.coef)
            err = _max_rel_error(np.maximum(ph, pb), y)
            if err < best_err:
                best, best_err = MaxAffine(head, body), err
            on_head = ph > pb
    return best
