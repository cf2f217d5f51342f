"""Does the demo really train? Mean reward of the first 10 updates against the last 10, with an error bar.

Runs the embedded demo (`treetrain train` defaults) into a run directory, or reads one that exists, and
reports both means, their difference and a Welch t statistic over the per-update means. The rise counts as
clear when the difference is above three standard errors. Exit status 1 when it is not.

    python bench/demo_reward.py --run-dir runs/demo            # read an existing run
    python bench/demo_reward.py --run-dir runs/demo --train    # run the demo first (several minutes)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from treetrain.train.metrics import read_metrics


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Difference of means (b - a) and its standard error."""
    va = statistics.variance(a) if len(a) > 1 else 0.0
    vb = statistics.variance(b) if len(b) > 1 else 0.0
    return statistics.fmean(b) - statistics.fmean(a), math.sqrt(va / len(a) + vb / len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--train", action="store_true", help="run the demo into --run-dir first")
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args()
    seconds = None
    if args.train:
        from treetrain.cli.main import main as cli

        start = time.perf_counter()
        code = cli(
            ["train", "--run-dir", str(args.run_dir), "--overwrite", "--no-progress", "--set", "threads=1"]
        )
        seconds = time.perf_counter() - start
        if code:
            return code
    rows = read_metrics(args.run_dir / "metrics.jsonl")
    if len(rows) < 2 * args.window:
        print(f"{args.run_dir}: {len(rows)} updates, need at least {2 * args.window}", file=sys.stderr)
        return 2
    rewards = [r.reward_mean for r in rows]
    first, last = rewards[: args.window], rewards[-args.window :]
    diff, se = welch(first, last)
    clear = diff > 3 * se
    timing = f", {seconds:.0f} s wall" if seconds is not None else ""
    print(
        f"updates {len(rows)}{timing}: mean reward first {args.window} = {statistics.fmean(first):.3f}, "
        f"last {args.window} = {statistics.fmean(last):.3f}, difference {diff:+.3f} "
        f"(standard error {se:.3f}, t = {diff / se if se else float('inf'):.1f}): "
        + ("clearly higher" if clear else "NOT clearly higher")
    )
    return 0 if clear else 1


if __name__ == "__main__":
    raise SystemExit(main())
