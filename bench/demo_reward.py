"""Does the demo really train? Mean reward of the first 10 updates against the last 10, with an error bar,
and the held-out evaluation before training against the last one.

Runs the embedded demo (`treetrain train` defaults, with `EVAL` added: held-out calculator tasks sampled at
the training temperature before training, every 20 updates and at the end) into a run directory, or reads
one that exists, and reports both training means, their difference and a Welch t statistic over the
per-update means. The held-out part pairs each task's pass fraction before training with the same task's
after the last update (the trees under `eval/update-XXXXX/`) and reports the mean paired difference and its
standard error. A rise counts as clear when the difference is above three standard errors. Exit status 1
when the training reward, or the held-out pass@1 of a run that has evaluations, did not clearly rise.

    python bench/demo_reward.py --run-dir runs/demo            # read an existing run
    python bench/demo_reward.py --run-dir runs/demo --train    # run the demo first (several minutes)
    python bench/demo_reward.py --run-dir runs/async --train --set rollout.max_staleness=1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from treetrain.train.metrics import read_evals, read_metrics

EVAL = [
    "--set", "eval.every=20", "--set", "eval.tasks=32", "--set", "eval.samples=4", "--set", "eval.greedy=false",
]  # fmt: skip
"""The demo's held-out evaluation: 32 tasks, 4 samples each at the training temperature (greedy decoding of
the shipped demo model already solves most tasks, so sampling is where training shows)."""


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
    parser.add_argument("--set", action="append", default=[], help="a setting for --train (key=value)")
    args = parser.parse_args()
    seconds = None
    if args.train:
        from treetrain.cli.main import main as cli

        start = time.perf_counter()
        code = cli(
            [
                "train",
                "--run-dir",
                str(args.run_dir),
                "--overwrite",
                "--no-progress",
                "--set",
                "threads=1",
                *EVAL,
                *(a for kv in args.set for a in ("--set", kv)),
            ]
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
    held = held_out(args.run_dir)
    if held is not None:
        print(held[0])
    return 0 if clear and (held is None or held[1]) else 1


def task_passes(run_dir: Path, update: int, threshold: float) -> dict[str, float]:
    """Each held-out task's fraction of passing samples in the evaluation after `update` updates."""
    from treetrain.tree.format import load_trees

    found: dict[str, float] = {}
    for path in sorted((run_dir / "eval" / f"update-{update:05d}" / "trees").glob("*.msgpack")):
        for tree in load_trees(path):
            rewards = [r.reward for r in tree.records]
            found[tree.records[0].id.split("/")[0]] = sum(x >= threshold for x in rewards) / len(rewards)
    return found


def held_out(run_dir: Path) -> tuple[str, bool] | None:
    """The held-out line (before training against the last evaluation) and whether pass@1 clearly rose;
    None for a run without evaluations."""
    from treetrain.train.resume import saved_config

    evals = read_evals(run_dir / "metrics.jsonl")
    if len(evals) < 2 or evals[0].update != 0:
        return None
    first, last = evals[0], evals[-1]
    threshold = saved_config(run_dir).eval.pass_threshold
    before, after = task_passes(run_dir, 0, threshold), task_passes(run_dir, last.update, threshold)
    tasks = sorted(before.keys() & after.keys())
    diffs = [after[t] - before[t] for t in tasks]
    if len(diffs) < 2:
        return f"held-out: {len(diffs)} tasks in both evaluations, too few to compare", False
    diff = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    rose = diff > 3 * se
    line = (
        f"held-out ({first.tasks} tasks x {first.samples} samples, {'greedy' if first.greedy else 'sampled'}): "
        f"pass@1 before training {first.pass_at_1:.3f}, after {last.update} updates {last.pass_at_1:.3f}; "
        f"pass@{first.samples} {first.pass_at_k:.3f} -> {last.pass_at_k:.3f}; mean reward {first.reward_mean:.3f} "
        f"-> {last.reward_mean:.3f}; paired difference in pass@1 {diff:+.3f} (standard error {se:.3f}, "
        f"t = {diff / se if se else float('inf'):.1f}): "
        + ("clearly higher" if rose else "NOT clearly higher")
    )
    return line, rose


if __name__ == "__main__":
    raise SystemExit(main())
