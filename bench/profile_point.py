"""Profile one geometry point in one mode: where an update's time goes, by kernel and by Python function.

    python bench/profile_point.py --mode response_only --prefix 2048 --depth 1
    python bench/profile_point.py --mode exact --prefix 8192 --depth 3 --top 30
    python bench/profile_point.py --quick            # a tiny point on the smoke-test model (seconds)

One point, not a grid: the model, tree and engine settings are `--grid targets`' (G = 8, S = 64 unless
given). It runs a warm-up update, `--reps` timed updates, then one update under cProfile and one under
torch.profiler, and prints the top entries of each (own time). The work is in `treetrain.benchmark`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from treetrain.benchmark.bench_config import MODES, QUICK, TARGETS, GridPoint
from treetrain.benchmark.workload import bench_batch, bench_model, time_one_update
from treetrain.memory.planner import attention_note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="response_only")
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2, help="timed updates before profiling")
    parser.add_argument("--top", type=int, default=20, help="entries printed per profile")
    parser.add_argument("--quick", action="store_true", help="the smoke test's tiny model and point")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else TARGETS
    point = (
        GridPoint(64, 2, 8, 1)
        if args.quick
        else GridPoint(args.prefix, args.branches, args.suffix, args.depth)
    )
    if min(point.prefix, point.branches, point.suffix, point.depth, args.reps + 1, args.top) < 1:
        parser.error("prefix, branches, suffix, depth and top must be >= 1, reps >= 0")
    if point.suffix < point.depth:
        parser.error(f"suffix {point.suffix} is shorter than depth {point.depth}: every turn needs a token")
    torch.set_num_threads(cfg.threads)
    model = bench_model(cfg.model)
    batch = bench_batch(point, cfg)
    print(f"{args.mode} at {point.label}, {cfg.threads} thread(s)")
    print(f"attention against resident KV: {attention_note(model)}")
    time_one_update(model, batch, args.mode, cfg)
    times = [time_one_update(model, batch, args.mode, cfg)[0] for _ in range(args.reps)]
    print("timed updates (s):", " ".join(f"{t:.3f}" for t in times))
    prof = cProfile.Profile()
    start = time.process_time()
    prof.runcall(time_one_update, model, batch, args.mode, cfg)
    print(f"cProfile run: {time.process_time() - start:.3f} s CPU")
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tprof:
        time_one_update(model, batch, args.mode, cfg)
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
