"""Interleaved repetitions: every repetition visits every point, and runs the modes in rotating order.

Interleaving spreads slow drifts of a shared machine (other processes, thermal state) over all modes
instead of charging them to whichever mode ran during the drift; rotating the order removes any
first-or-last-in-a-point effect. The median of the repetitions is reported.

Example:
    >>> [rotation(r, 0) for r in range(3)]
    [('flat', 'exact', 'response_only'), ('exact', 'response_only', 'flat'), ('response_only', 'flat', 'exact')]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from transformers import PreTrainedModel

from treetrain.benchmark.bench_config import MODES, BenchConfig, GridPoint, Mode
from treetrain.benchmark.workload import time_one_update
from treetrain.replay.batch import ReplayReport, UpdateBatch


def rotation(rep: int, index: int, modes: Sequence[Mode] = MODES) -> tuple[Mode, ...]:
    """The order of the modes in repetition `rep` at point number `index`."""
    k = (rep + index) % len(modes)
    return tuple(modes[k:]) + tuple(modes[:k])


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def interleaved(
    model: PreTrainedModel,
    points: Sequence[GridPoint],
    batches: Sequence[UpdateBatch],
    cfg: BenchConfig,
    *,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[dict[tuple[GridPoint, Mode], list[float]], dict[tuple[GridPoint, Mode], ReplayReport]]:
    """Seconds per update of every (point, mode) over `cfg.reps` interleaved repetitions, and one report each."""
    times: dict[tuple[GridPoint, Mode], list[float]] = {(p, m): [] for p in points for m in MODES}
    reports: dict[tuple[GridPoint, Mode], ReplayReport] = {}
    for rep in range(cfg.reps):
        for i, (point, batch) in enumerate(zip(points, batches)):
            for mode in rotation(rep, i):
                seconds, report = time_one_update(model, batch, mode, cfg)
                times[(point, mode)].append(seconds)
                reports.setdefault((point, mode), report)
            cells = "  ".join(f"{m} {times[(point, m)][-1]:.2f}s" for m in MODES)
            log(f"rep {rep + 1}/{cfg.reps} {point.label}: {cells}")
    return times, reports
