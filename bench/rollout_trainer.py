"""The trainer's own rollout path against the sequential loop, side by side in one process.

    python bench/rollout_trainer.py                      # about a minute on two cores
    python bench/rollout_trainer.py --rounds 4 --out /tmp/t.md

`bench/rollout_engines.py` times `rollout_trees` with an engine it made itself. This times what a run
times as `rollout_seconds`: a real `Trainer` on the demo config (`threads=1`) is built, and each round
grows one update's tasks three ways, in an order that alternates A B C, C B A, so that load on a shared
machine falls on each alike:

- `trainer`: `RolloutSource.produce`, the trainer's call (its engine, its environment workers, its tree
  writer and `rollout_seconds`);
- `sequential, env workers`: the sequential loop (`concurrent=False`) on the same config and workers,
  the baseline `bench/rollout_engines.py` uses;
- `sequential, in process`: the sequential loop with environments in the trainer's process, the way the
  trainer grew trees before environments moved to worker processes (the baseline of an outside
  comparison against that older trainer).

No weights change between rounds (no update runs), so the three see the same policy. Round 0 is a
warm-up and is not counted. The table reports seconds per sampled token and each ratio to `trainer`.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from envs.registry import make_env
from treetrain.io import atomic_write_text
from treetrain.rollout.sources.engine_config import rollout_config
from treetrain.rollout.sources.run_settings import task_seeds
from treetrain.rollout.sources.sync_source import RolloutSource
from treetrain.rollout.tree_rollout import rollout_trees
from treetrain.train.config import load_config
from treetrain.train.loop import Trainer

WAYS = ("trainer", "sequential, env workers", "sequential, in process")


def measure(rounds: int) -> dict[str, list[tuple[float, int]]]:
    """(seconds, sampled tokens) of each way, per counted round."""
    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_config(None, [f"run_dir={scratch}/run", "threads=1", f"updates={rounds + 1}"])
        trainer = Trainer(cfg, progress=False)
        try:
            source = trainer.source
            assert isinstance(source, RolloutSource)  # the demo config: synchronous rollouts
            model, version = trainer.backend.module, trainer.state.version
            sequential = replace(rollout_config(cfg, source.wrapper, version), concurrent=False)

            def trainer_way(update: int) -> tuple[float, int]:
                produced = source.produce(model, update, version)
                return produced.seconds, source.stats.sampled_tokens

            def sequential_way(envs: Callable[[], object]) -> Callable[[int], tuple[float, int]]:
                def run(update: int) -> tuple[float, int]:
                    was_training = model.training
                    model.eval()
                    with tempfile.TemporaryDirectory() as out:
                        start = time.perf_counter()
                        result = rollout_trees(
                            model, trainer.tokenizer, envs, task_seeds(cfg, update), out, sequential,  # type: ignore[arg-type]
                            env_name=cfg.env.name,
                        )  # fmt: skip
                        seconds = time.perf_counter() - start
                    model.train(was_training)
                    return seconds, result.stats.sampled_tokens

                return run

            ways = dict(zip(WAYS, (trainer_way, sequential_way(trainer.envs), sequential_way(
                lambda: make_env(cfg.env.name, **cfg.env.kwargs)))))  # fmt: skip
            times: dict[str, list[tuple[float, int]]] = {w: [] for w in WAYS}
            for update in range(rounds + 1):
                order = WAYS if update % 2 else WAYS[::-1]
                for way in order:
                    got = ways[way](update)
                    if update:  # round 0 warms every path up
                        times[way].append(got)
            return times
        finally:
            trainer.close()


def table(times: dict[str, list[tuple[float, int]]], rounds: int) -> str:
    per_token = {w: [s / n for s, n in times[w]] for w in WAYS}
    lines = [
        f"# The trainer's rollout against the sequential loop ({rounds} rounds, {os.cpu_count()} cores)",
        "",
        "| rollout | seconds | sampled tokens | ms per sampled token (median) | per token, against `trainer` (median of rounds) |",
        "|---|---|---|---|---|",
    ]
    for way in WAYS:
        ratio = statistics.median(a / b for a, b in zip(per_token[way], per_token["trainer"]))
        seconds, tokens = sum(s for s, _ in times[way]), sum(n for _, n in times[way])
        lines.append(
            f"| {way} | {seconds:.2f} s | {tokens} | {1e3 * statistics.median(per_token[way]):.2f} | {ratio:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=6, help="updates' worth of tasks per way, after a warm-up"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    text = table(measure(args.rounds), args.rounds)
    print(text)
    if args.out:
        atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
