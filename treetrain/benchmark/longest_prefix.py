"""The longest prefix that fits a device-memory limit, per geometry and mode.

Prefixes are searched over multiples of `search_step`: galloping (doubling until the peak exceeds the
limit), then bisection, which assumes the peak grows with the prefix (true of resident KV, KV-gradient
accumulators and graphs alike). Every probe is at most twice the answer.

- Flat is searched against *measured* peaks. Flat runs one trajectory per microbatch, so a one-trajectory
  batch of the geometry has the same peak, and its probes are short: measuring is cheap. The ledger has
  no flat model, and the calibrated memory model extrapolates badly to long whole sequences.
- A tree mode may lower K (branches per replay step) to fit, as a planner would: K = cfg.microbatch,
  then halved down to 1; the longest prefix over those K wins (the larger K on a tie). It is searched
  against the ledger's *prediction*, which costs no model run.
- `refine` then checks a tree mode's answer with a measured run. If the measured peak fits, the answer
  is confirmed (a lower bound: a longer prefix might fit too); if not, the prediction was too low and
  the answer is corrected by a measured bisection below it.

Example:
    >>> fit = longest_prefix(model, (8, 64, 1), "exact", FULL)                        # doctest: +SKIP
    >>> refine(model, fit, FULL).prefix <= fit.prefix                                  # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from transformers import PreTrainedModel

from treetrain.benchmark.bench_config import BenchConfig, GridPoint, Mode
from treetrain.benchmark.memory import measure_peak, predict_peak
from treetrain.benchmark.workload import bench_batch
from treetrain.lifetime import ClassBytes
from treetrain.replay.batch import UpdateBatch

Judged = Literal["measured", "predicted", "confirmed", "corrected"]


@dataclass(frozen=True)
class PrefixFit:
    """The longest prefix (a multiple of the search step) whose peak fits the limit."""

    branches: int
    suffix: int
    depth: int
    mode: Mode
    microbatch: int
    """K the answer uses (flat: trajectories per microbatch)."""
    prefix: int
    """The answer; 0 when not even one search step fits."""
    capped: bool
    """The search's upper end fits: the true longest prefix is at least `prefix`."""
    judged: Judged
    """measured: searched against measured peaks; predicted: against the ledger only; confirmed: the
    predicted answer's measured peak fits; corrected: it did not, and a measured search shortened it."""
    predicted_prefix: int
    """The answer by prediction alone (flat: the same as `prefix`)."""
    predicted: ClassBytes
    """Predicted peak at `prefix`."""
    measured: ClassBytes | None = None
    """Measured peak at `prefix`, when measured."""


def flat_search_batch(prefix: int, suffix: int, depth: int, cfg: BenchConfig) -> UpdateBatch:
    """One trajectory of the geometry: flat's peak is one microbatch's, the same for any G."""
    return bench_batch(GridPoint(prefix, 1, suffix, depth), cfg)


def gallop_bisect(fits: Callable[[int], bool], top: int) -> tuple[int, bool]:
    """Largest n in [0, top] with fits(n) (fits(0) assumed), and whether n == top; fits must be monotone.

    Example:
        >>> gallop_bisect(lambda n: n <= 37, 100), gallop_bisect(lambda n: True, 100)
        ((37, False), (100, True))
    """
    lo, hi = 0, 1  # lo fits, hi is the next probe
    while hi <= top and fits(hi):
        lo, hi = hi, (min(2 * hi, top) if hi < top else top + 1)
    if lo == top:
        return lo, True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, False


def microbatches(k: int) -> tuple[int, ...]:
    """K, then halved down to 1: `microbatches(4) == (4, 2, 1)`."""
    out = [k]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return tuple(out)


def longest_prefix(
    model: PreTrainedModel,
    shape: tuple[int, int, int],
    mode: Mode,
    cfg: BenchConfig,
    *,
    log: Callable[[str], None] = lambda _: None,
) -> PrefixFit:
    """Search geometry `shape` = (G, suffix, depth) in `mode` (see the module docstring)."""
    g, s, d = shape
    step, top = cfg.search_step, cfg.max_search_prefix // cfg.search_step
    if mode == "flat":
        measured: dict[int, ClassBytes] = {}

        def flat_fits(n: int) -> bool:
            measured[n] = measure_peak(model, flat_search_batch(n * step, s, d, cfg), "flat", cfg)
            return measured[n].total <= cfg.memory_limit

        n, capped = gallop_bisect(flat_fits, top)
        log(f"  longest prefix G={g} S={s} d={d} flat: {n * step} ({len(measured)} measured runs)")
        at = flat_search_batch(n * step, s, d, cfg)
        predicted = predict_peak(model, at, mode, cfg) if n else ClassBytes()
        return PrefixFit(
            g,
            s,
            d,
            mode,
            cfg.flat_microbatch,
            n * step,
            capped,
            "measured",
            n * step,
            predicted,
            measured.get(n),
        )
    best: PrefixFit | None = None
    for k in microbatches(cfg.microbatch):
        ck = replace(cfg, microbatch=k)
        peaks: dict[int, ClassBytes] = {}

        def tree_fits(n: int, ck: BenchConfig = ck, peaks: dict[int, ClassBytes] = peaks) -> bool:
            peaks[n] = predict_peak(model, bench_batch(GridPoint(n * step, g, s, d), ck), mode, ck)
            return peaks[n].total <= ck.memory_limit

        n, capped = gallop_bisect(tree_fits, top)
        fit = PrefixFit(g, s, d, mode, k, n * step, capped, "predicted", n * step, peaks.get(n, ClassBytes()))
        if best is None or fit.prefix > best.prefix:
            best = fit
    assert best is not None
    log(f"  longest prefix G={g} S={s} d={d} {mode}: {best.prefix} with K={best.microbatch} (predicted)")
    return best


def refine(model: PreTrainedModel, fit: PrefixFit, cfg: BenchConfig) -> PrefixFit:
    """Check a tree mode's predicted answer with measured runs (see the module docstring)."""
    if fit.mode == "flat" or fit.prefix == 0:
        return fit
    ck = replace(cfg, microbatch=fit.microbatch)
    step = cfg.search_step
    measured: dict[int, ClassBytes] = {}

    def fits(n: int) -> bool:
        if n not in measured:
            batch = bench_batch(GridPoint(n * step, fit.branches, fit.suffix, fit.depth), ck)
            measured[n] = measure_peak(model, batch, fit.mode, ck)
        return measured[n].total <= cfg.memory_limit

    top = fit.prefix // step
    if fits(top):
        return replace(fit, judged="confirmed", measured=measured[top])
    lo, hi = 0, top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    at = bench_batch(GridPoint(lo * step, fit.branches, fit.suffix, fit.depth), ck)
    predicted = predict_peak(model, at, fit.mode, ck) if lo else ClassBytes()
    return replace(
        fit,
        prefix=lo * step,
        capped=False,
        judged="corrected",
        predicted=predicted,
        measured=measured.get(lo),
    )
