"""Run the whole geometry benchmark: memory, timing, the longest-prefix search, and the report.

Order of work, so that nothing measured is disturbed by anything else:

1. build every grid point's tree and update batch;
2. predict each (point, mode)'s peak (the calibration runs here, once per contract);
3. measure each (point, mode)'s peak with the tracker; this is also every mode's warm-up run. Flat's
   peak is one microbatch's (one trajectory, all of equal length), so it is measured on a one-trajectory
   batch of the same geometry;
4. time `cfg.reps` interleaved repetitions (no tracker attached);
5. search the longest prefix within the memory limit per (G, suffix, depth) and mode
   (`treetrain.benchmark.longest_prefix`: flat against measured peaks, the tree modes against the ledger), and
   check the tree modes' answers with measured runs at the chosen combinations;
6. write `geometry.json`, `geometry.md` and the PNGs into the output directory (atomically).

Example:
    >>> results = run_bench(QUICK, Path("bench/out/quick"), command="python bench/geometry.py --quick")  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from treetrain.benchmark.bench_config import MODES, BenchConfig, Mode
from treetrain.benchmark.flops import FlopModel, flop_ceiling
from treetrain.benchmark.longest_prefix import PrefixFit, flat_search_batch, longest_prefix, refine
from treetrain.benchmark.memory import measure_peak, predict_peak, response_graph_bytes
from treetrain.benchmark.report import markdown, write_plots
from treetrain.benchmark.results import BenchResults, Machine, ModeResult, PointResult, to_json
from treetrain.benchmark.timing import interleaved
from treetrain.benchmark.workload import bench_batch, bench_model, bench_tree
from treetrain.io import atomic_write_text
from treetrain.models.support import check_supported
from treetrain.tree.stats import tree_stats


def host_description() -> str:
    """CPU model and core count, e.g. 'Intel(R) Xeon(R) ... x 2 cores'."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def run_bench(
    cfg: BenchConfig, out_dir: Path, *, command: str, log: Callable[[str], None] = lambda _: None
) -> BenchResults:
    """Run the benchmark of `cfg`, write its outputs into `out_dir`, and return the results."""
    start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    model = bench_model(cfg.model)
    points = cfg.points()
    trees = [bench_tree(p, cfg) for p in points]
    batches = [bench_batch(p, cfg, t) for p, t in zip(points, trees)]
    check_supported(model, max(tree_stats(t).max_sequence_length for t in trees))
    log(f"{len(points)} points, {sum(tree_stats(t).total_tokens for t in trees)} flat tokens per repetition")

    predicted = {(p, m): predict_peak(model, b, m, cfg) for p, b in zip(points, batches) for m in MODES}
    graphs = {
        (p, m): response_graph_bytes(model, b, m, cfg) for p, b in zip(points, batches) for m in MODES[1:]
    }
    log(f"predicted peaks ({time.perf_counter() - start:.0f}s)")
    measured = {}
    for p, b in zip(points, batches):
        for m in MODES:
            # flat's peak is one microbatch's: a one-trajectory batch of the geometry has the same peak
            one = flat_search_batch(p.prefix, p.suffix, p.depth, cfg) if m == "flat" else b
            measured[(p, m)] = measure_peak(model, one, m, cfg)
        log(f"measured peaks {p.label} ({time.perf_counter() - start:.0f}s)")
    times, reports = interleaved(model, points, batches, cfg, log=log)

    fits: list[PrefixFit] = []
    flat_fits: dict[tuple[int, int], PrefixFit] = {}
    for shape in cfg.shapes():
        g, s, d = shape
        for mode in MODES:
            if mode == "flat" and (s, d) in flat_fits:  # flat's peak does not depend on G
                fits.append(replace(flat_fits[(s, d)], branches=g))
                continue
            fit = longest_prefix(model, shape, mode, cfg, log=log)
            if shape in cfg.confirm:
                fit = refine(model, fit, cfg)
                log(f"  measured: {fit.mode} {fit.judged} at {fit.prefix}")
            if mode == "flat":
                flat_fits[(s, d)] = fit
            fits.append(fit)
    log(f"longest prefixes ({time.perf_counter() - start:.0f}s)")

    results_points = []
    flop_model = FlopModel.of(model)
    for p, tree in zip(points, trees):
        stats = tree_stats(tree)
        ceiling: dict[Mode, int] = {
            "flat": stats.cost_flat(),
            "exact": stats.cost_exact(),
            "response_only": stats.cost_response_only(),
        }
        modes = tuple(
            ModeResult(
                m,
                tuple(times[(p, m)]),
                reports[(p, m)].token_cost,
                ceiling[m],
                measured[(p, m)],
                predicted[(p, m)],
                graphs.get((p, m), 0),
                flop_ceiling(tree, m, flop_model),
            )
            for m in MODES
        )
        results_points.append(PointResult(p, modes))
    machine = Machine(
        command=command,
        date=datetime.date.today().isoformat(),
        host=host_description(),
        torch=torch.__version__,
        threads=cfg.threads,
        wall_seconds=time.perf_counter() - start,
    )
    results = BenchResults(cfg, machine, tuple(results_points), tuple(fits))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "geometry.json", to_json(results))
    write_report(results, out_dir)
    return results


def write_report(results: BenchResults, out_dir: Path) -> None:
    """`geometry.md` and the PNGs of `results` in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "geometry.md", markdown(results))
    write_plots(results, out_dir)
