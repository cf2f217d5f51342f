"""Rollout time per flat token of the demo, this tree against an older commit, run after run.

    python bench/rollout_against.py                    # against b4ab5e0 (the sequential trainer), 1 round
    python bench/rollout_against.py --old HEAD --rounds 2   # the same code on both sides: no bias

This is the outside measurement of issue 30, item 5. Each side runs five demo updates (`treetrain train
--set updates=5 --set threads=1 --no-progress`), both from this venv, with `PYTHONPATH` set to its own
tree. `--old` is checked out into a temporary `git worktree`, which is removed afterwards. The runs go in
the order A B B A for each round, so that drift on the machine falls on both sides alike. For updates 1-4
the script divides `rollout_seconds` by `flat_token_cost`, pairs the updates of the two sides run by run,
and prints the median ratio, this tree over the old one (below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def per_token(tree: Path, run_dir: Path) -> list[float]:
    """`rollout_seconds / flat_token_cost` of updates 1-4 of a five-update demo run from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree), DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "treetrain", "train", "--run-dir", str(run_dir), "--overwrite",
           "--set", "threads=1", "--set", "updates=5", "--no-progress"]  # fmt: skip
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r["rollout_seconds"] / r["flat_token_cost"] for r in rows if 1 <= r["update"] <= 4]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--old", default="b4ab5e0", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of A B B A")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: must be at least 1")
    with tempfile.TemporaryDirectory() as scratch:
        old = Path(scratch) / "old"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(old), args.old], check=True
        )
        try:
            trees = {"this": REPO, "old": old}
            seen: dict[str, list[list[float]]] = {"this": [], "old": []}
            for i, side in enumerate(["this", "old", "old", "this"] * args.rounds):
                seen[side].append(per_token(trees[side], Path(scratch) / f"run-{i}"))
                print(f"{side}: ms per flat token {[round(x * 1e3, 3) for x in seen[side][-1]]}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    ratios = [a / b for xs, ys in zip(seen["this"], seen["old"]) for a, b in zip(xs, ys)]
    median = statistics.median(ratios)
    print(f"per-update ratios, this over {args.old}: {[round(r, 3) for r in ratios]}")
    print(f"median {median:.3f}: {1 / median:.2f}x less rollout time per flat token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
