"""The geometry benchmark: `flat`, `exact` and `response_only` side by side on one grid, in one run.

    python bench/geometry.py                 # the full grid (README's table; tens of minutes on 2 cores)
    python bench/geometry.py --quick         # a seconds-long smoke run on a tiny model and grid
    python bench/geometry.py --grid targets --out bench/out/targets   # the target points only
    python bench/geometry.py --grid real-layer --out bench/out/real-layer   # one real-size layer
    python bench/geometry.py --reps 5 --threads 1 --out bench/out/run2
    python bench/geometry.py --render bench/out/geometry.json   # rewrite the report and PNGs only

Writes `geometry.md` (tables and targets), `geometry.json` (everything, for the notebooks) and PNG plots
into `--out` (default bench/out). The work is in `treetrain.benchmark`; see its `config` module for the
grid, the model and the engine settings.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from treetrain.benchmark.bench_config import GRIDS, with_overrides
from treetrain.benchmark.report import check_lines
from treetrain.benchmark.results import all_checks, from_json
from treetrain.benchmark.suite import run_bench, write_report
from treetrain.viz._mpl import use_file_backend


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and grid (smoke test)")
    parser.add_argument("--grid", choices=sorted(GRIDS), default=None, help="which grid (default full)")
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default bench/out, or bench/out/GRID)"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per point and mode")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="only rewrite geometry.md and PNGs from a result file"
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        use_file_backend()
        results = from_json(args.render.read_text())
        out = args.out or args.render.parent
        write_report(results, out)
        print(f"wrote {out / 'geometry.md'} and PNGs from {args.render}")
        return 0
    name = "quick" if args.quick else args.grid or "full"
    cfg = GRIDS[name]
    if args.reps is not None:
        cfg = with_overrides(cfg, reps=args.reps)
    if args.threads is not None:
        cfg = with_overrides(cfg, threads=args.threads)
    out = args.out or Path("bench/out" if name == "full" else f"bench/out/{name}")
    use_file_backend()
    command = shlex.join(["python", "bench/geometry.py", *(argv if argv is not None else sys.argv[1:])])
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", file=sys.stderr, flush=True)

    results = run_bench(cfg, out, command=command, log=log)
    print("\n".join(check_lines(all_checks(results))))
    print(f"wrote {out / 'geometry.md'}, {out / 'geometry.json'} and PNGs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
