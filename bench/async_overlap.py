"""Asynchronous against synchronous training on the demo: wall time, side by side, and staleness.

Runs the same demo training (`treetrain train`, the embedded demo task, `threads=1`) with
`rollout.max_staleness=1` and with 0, interleaved A B B A so that a machine that slows down or warms up
weighs on both alike, each in a fresh process, and reports per engine:

- the **update loop's wall time**: the training thread's seconds over updates 1..N-1 (the first update
  plans and calibrates; it is reported apart), that is the sum of `trainer_idle_seconds` (waiting for trees)
  and `train_seconds` of each update's metrics row. In a synchronous run the trainer waits for each whole
  rollout; in an asynchronous one only for what the sampler has not yet finished;
- the ratio K=1 / K=0 of those wall times (target on the 2-core CPU machine: at most 0.75), beside the
  bound max(rollout, train) / (rollout + train) of the synchronous runs' own split;
- the **whole run's wall time**, end to end (the `treetrain train` process, start-up and exit included),
  and its ratio K=1 / K=0: what a user waits for;
- from how many updates K=1 pays end to end: the whole run's extra fixed cost at K=1 (everything but
  updates 1..N-1: start-up, update 0, the end) over the loop's saving per update, plus one;
- the staleness histogram of every trained policy token of the K=1 runs (read from the tree files).

    python bench/async_overlap.py                          # hf and vllm (demo-wide), 8 updates, 2 pairs
    python bench/async_overlap.py --engines hf --updates 6 --pairs 1 --out bench/out/async_overlap.md

`fleet` is two trainer ranks (`torchrun`, DeepSpeed ZeRO-3) on `vllm-server`, fed by the servers `--urls`
names, started first with the command of docs/rollout-engines.md (one per port):

    python bench/async_overlap.py --engines fleet --urls http://127.0.0.1:8000,http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from treetrain.benchmark.report import publish
from treetrain.rollout.sources.produced import lags_of
from treetrain.rollout.sources.staleness import Staleness
from treetrain.rollout.sources.tree_queue import read_queued
from treetrain.train.metrics import UpdateMetrics, read_metrics

ENGINE_SETTINGS = {
    "hf": ["model.path=demo"],
    "vllm": ["model.path=demo-wide", "rollout.engine=vllm"],
}
"""The demo as each engine runs it (vLLM on CPU serves the 64-wide-head `demo-wide`)."""
FLEET = [
    "model.path=demo-wide", "rollout.engine=vllm-server", "distributed.backend=deepspeed",
    "distributed.zero_stage=3",
]  # fmt: skip
"""`fleet`: two ZeRO-3 ranks on the servers of `--urls`."""


@dataclass(frozen=True)
class Run:
    """One training run's measurements."""

    engine: str
    staleness: int
    loop_seconds: float
    """Training-thread seconds over updates 1..N-1."""
    first_seconds: float
    """The same for update 0."""
    rollout_seconds: float
    train_seconds: float
    process_seconds: float
    lags: tuple[tuple[int, int], ...]


def train(engine: str, k: int, updates: int, run: Path, urls: Sequence[str] = ()) -> Run:
    engine_settings = (
        [*FLEET, f"rollout.vllm.urls={json.dumps(urls)}"] if engine == "fleet" else ENGINE_SETTINGS[engine]
    )
    settings = [
        *engine_settings, f"updates={updates}", f"rollout.max_staleness={k}", "threads=1",
        "measure_memory_every=0", "checkpoint_every=0", "checkpoint_every_s=0",
    ]  # fmt: skip
    launch = [sys.executable, "-m"]
    if engine == "fleet":
        launch += [
            "torch.distributed.run",
            "--standalone",  # a free port of its own
            "--nproc_per_node=2",
            "-m",
        ]
    args = [*launch, "treetrain", "train", "--run-dir", str(run), "--overwrite", "--no-progress"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [*args, *(a for kv in settings for a in ("--set", kv))],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{engine} K={k}: treetrain train failed: {proc.stderr[-2000:]}")
    rows = read_metrics(run / "metrics.jsonl")
    return Run(
        engine, k, sum(_loop(r) for r in rows[1:]), _loop(rows[0]),
        sum(r.rollout_seconds for r in rows[1:]), sum(r.train_seconds for r in rows[1:]), seconds,
        _lags(run, rows) if k else (),
    )  # fmt: skip


def _loop(row: UpdateMetrics) -> float:
    return row.trainer_idle_seconds + row.train_seconds


def _lags(run: Path, rows: list[UpdateMetrics]) -> tuple[tuple[int, int], ...]:
    """Every trained token's lag (the trees an update took, at the version it trained at)."""
    lags = Staleness()
    for row in rows:
        before = rows[row.update - 1].version if row.update else 0
        lags = lags.merged(lags_of(read_queued(run, row.update).trees, before))
    return lags.histogram


def pays_from(sync_loop: float, lagged_loop: float, sync_run: float, lagged_run: float, updates: int) -> str:
    """From how many updates a K=1 run ends no later than a K=0 one: its extra fixed cost (the whole run
    less the loop over updates 1..N-1) over the loop's saving per update, plus one (update 0).

    >>> pays_from(10.0, 7.0, 20.0, 21.0, 11)  # 4 s more outside the loop, 0.3 s saved per update
    '15'
    >>> pays_from(10.0, 7.0, 20.0, 16.0, 11), pays_from(7.0, 7.0, 20.0, 21.0, 11)
    ('1', 'never')
    """
    saved = (sync_loop - lagged_loop) / (updates - 1)
    extra = (lagged_run - lagged_loop) - (sync_run - sync_loop)
    if extra <= 0:
        return "1"
    if saved <= 0:
        return "never"
    return str(math.ceil(1 + extra / saved))


def report(runs: list[Run], updates: int, command: str) -> str:
    lines = [
        f"`{command}`, {updates} updates per run: the loop is the training thread's wall time over updates "
        f"1..{updates - 1}, the run the whole `treetrain train` process's",
        "",
        "| engine | K=0 loop s (median) | K=1 loop s (median) | loop ratio K=1/K=0 | bound of the K=0 split | "
        "K=0 rollout / train s | K=0 run s (median) | K=1 run s (median) | run ratio K=1/K=0 | "
        "K=1 pays from (updates) | trained-token lags (K=1) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for engine in dict.fromkeys(r.engine for r in runs):
        sync = [r for r in runs if r.engine == engine and r.staleness == 0]
        lagged = [r for r in runs if r.engine == engine and r.staleness == 1]
        a = statistics.median(r.loop_seconds for r in sync)
        b = statistics.median(r.loop_seconds for r in lagged)
        roll = statistics.median(r.rollout_seconds for r in sync)
        step = statistics.median(r.train_seconds for r in sync)
        counts: Counter[int] = Counter()
        for r in lagged:
            counts.update(dict(r.lags))
        total = sum(counts.values())
        hist = ", ".join(f"lag {lag}: {100 * n / total:.1f}%" for lag, n in sorted(counts.items()))
        whole_a = statistics.median(r.process_seconds for r in sync)
        whole_b = statistics.median(r.process_seconds for r in lagged)
        lines.append(
            f"| {engine} | {a:.1f} | {b:.1f} | {b / a:.2f} | {max(roll, step) / (roll + step):.2f} | "
            f"{roll:.1f} / {step:.1f} | {whole_a:.1f} | {whole_b:.1f} | **{whole_b / whole_a:.2f}** | "
            f"{pays_from(a, b, whole_a, whole_b, updates)} | {hist} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm, fleet")
    parser.add_argument("--urls", default="", help="fleet: the servers' base URLs, comma-separated")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=2, help="A B B A blocks per engine")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    urls = [u for u in args.urls.split(",") if u]
    known = {*ENGINE_SETTINGS, "fleet"}
    if not engines or any(e not in known for e in engines) or args.updates < 2 or args.pairs < 1:
        print(f"async_overlap: engines from {sorted(known)}, --updates >= 2, --pairs >= 1", file=sys.stderr)
        return 2
    if "fleet" in engines and not urls:
        print("async_overlap: fleet needs --urls (the servers' base URLs, started first)", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:
            for p in range(args.pairs):
                for k in (0, 1, 1, 0):
                    run = train(engine, k, args.updates, Path(tmp) / f"{engine}-{p}-{k}", urls)
                    print(
                        f"{engine} K={k}: loop {run.loop_seconds:.1f} s, run {run.process_seconds:.1f} s, "
                        f"update 0 {run.first_seconds:.1f} s",
                        file=sys.stderr,
                    )
                    runs.append(run)
    command = "python bench/async_overlap.py " + " ".join(sys.argv[1:])
    publish(report(runs, args.updates, command.strip()), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
