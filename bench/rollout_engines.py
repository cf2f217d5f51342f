"""Rollout engines side by side on the demo's rollouts: the sequential loop, concurrent `hf`, and `vllm`.

    python bench/rollout_engines.py                       # about three minutes on two cores
    python bench/rollout_engines.py --rounds 2 --demo-updates 0 --out /tmp/r.md   # a quick look

Every engine grows the same tasks (the trainer's task seeds for updates 0..rounds-1: the demo's four groups,
eight samples at the root, the calculator in its worker process, temperature 1). Four tables, markdown to
stdout and `--out`:

1. rollout wall time and sampled tokens per second of each engine, and the ratio to the sequential loop;
2. greedy decoding: whether concurrent `hf` grows exactly the sequential loop's trees (it must);
3. prefix-cache hit rate of each engine against the shared-token fraction: the share of context tokens a
   request repeats from an earlier request or sample (what a perfect cache would serve; the calculator's
   system prompt is shared across trees too);
4. the demo's own wall time (`treetrain train`, `--demo-updates` updates) with each engine.

`vllm` samples from `demo-wide`, the demo model with 64-dimensional heads (vLLM's CPU attention has no
16-dimensional kernel): the same function, so the same work. Without vLLM installed its rows say so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.remote import WorkerEnvFactory
from envs.wrapper import EpisodeLimits, WrapperConfig
from treetrain.io import atomic_write_text
from treetrain.rollout.engines.generation import GenerationRequest, GenerationResult
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.rollout.engines.recording_engine import RecordingEngine
from treetrain.rollout.prefix_sampler import SamplerConfig
from treetrain.rollout.sampling import Sampling
from treetrain.rollout.sources.run_settings import task_seeds
from treetrain.rollout.tree_rollout import RolloutConfig, rollout_trees
from treetrain.train.config import TrainConfig
from treetrain.train.models import DEMO_MODEL, WIDE_DEMO_MODEL

WRAPPER = WrapperConfig(EpisodeLimits(max_episode_tokens=1024), stop_token_ids=(2,))


def shared_fraction(asked: dict[int, GenerationRequest], answers: list[GenerationResult]) -> float:
    """Of all context tokens, the share that an earlier request's context or sample already covered (the
    most any prefix cache could serve; each request keeps at least one token to encode)."""
    known: list[tuple[int, ...]] = []  # one cache serves every tree: the system prompt is shared too
    answered = {r.request_id: r for r in answers}
    total = shared = 0
    for rid in sorted(asked):
        req = asked[rid]
        best = 0
        for prefix in known:
            n = next(
                (i for i, (a, b) in enumerate(zip(prefix, req.context)) if a != b),
                min(len(prefix), len(req.context)),
            )
            best = max(best, n)
        total += len(req.context)
        shared += min(best, len(req.context) - 1)
        known.append(req.context)
        for c in answered[rid].completions if rid in answered else ():
            known.append(req.context + c.tokens)
    return shared / total if total else 0.0


@dataclass
class Row:
    name: str
    seconds: float
    tokens: int
    cached: float | None = None
    shared: float | None = None

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def run_engines(
    engines: dict[str, tuple[Any, Any]], tok: Any, rounds: int, sampling: Sampling
) -> tuple[list[Row], dict[str, list[str]]]:
    """Grow each update's tasks with every engine in turn (round by round, so that load on the machine
    falls on all of them alike); `engines` maps a name to (model, engine), engine None for the sequential
    loop."""
    cfg = TrainConfig()
    factory = WorkerEnvFactory("calculator", {})
    ids: dict[str, list[str]] = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    recorders = {name: RecordingEngine(e) if e is not None else None for name, (_, e) in engines.items()}
    try:
        for update in range(rounds):
            for name, (model, engine) in engines.items():
                config = RolloutConfig(
                    sampler=SamplerConfig(sampling, seed=0), wrapper=WRAPPER, concurrent=engine is not None
                )
                with tempfile.TemporaryDirectory() as out:
                    start = time.perf_counter()
                    result = rollout_trees(model, tok, factory, task_seeds(cfg, update), out, config,
                                           env_name="calculator", engine=recorders[name])  # fmt: skip
                    seconds[name] += time.perf_counter() - start
                tokens[name] += result.stats.sampled_tokens
                ids[name] += [t.id for t in result.trees]
    finally:
        factory.close()
    rows = []
    for name in engines:
        row = Row(name, seconds[name], tokens[name])
        recorder = recorders[name]
        if recorder is not None and recorder.engine.stats.prompt_tokens:
            row.cached = recorder.engine.stats.cache_hit_rate
            row.shared = shared_fraction(recorder.asked, recorder.answers)
        rows.append(row)
    return rows, ids


def demo_wall_time(engine: str, updates: int) -> str:
    model = "demo-wide" if engine == "vllm" else "demo"
    with tempfile.TemporaryDirectory() as run:
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "treetrain", "train", "--run-dir", f"{run}/r", "--no-progress",
             "--set", f"updates={updates}", "--set", "threads=1", "--set", f"rollout.engine={engine}",
             "--set", f"model.path={model}"],
            capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"},
        )  # fmt: skip
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return f"| {engine} | failed: {proc.stderr.strip().splitlines()[-1][:120]} | | |"
        metrics = [json.loads(line) for line in Path(f"{run}/r/metrics.jsonl").read_text().splitlines()]
    rollout = sum(m["rollout_seconds"] for m in metrics)
    return f"| {engine} | {wall:.0f} s | {rollout:.0f} s | {metrics[-1]['reward_mean']:.3f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="updates' worth of tasks per engine")
    parser.add_argument(
        "--demo-updates", type=int, default=10, help="updates of the demo per engine (0: skip)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL).eval()
    hot, greedy = Sampling(temperature=1.0), Sampling(temperature=0.0)
    engines: dict[str, tuple[Any, Any]] = {
        "sequential hf": (model, None),
        "concurrent hf": (model, HFEngine(model)),
    }
    vllm_note = ""
    try:
        from treetrain.rollout.engines.engine_settings import VLLMSettings
        from treetrain.rollout.engines.vllm_engine import VLLMEngine

        wide = AutoModelForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
        engines["vllm"] = (
            wide,
            VLLMEngine(str(WIDE_DEMO_MODEL), VLLMSettings(), dtype="float32", max_model_len=1024),
        )
    except Exception as exc:  # not installed, or no kernel for this machine: say so in the table
        vllm_note = f"vllm: not measured ({type(exc).__name__}: {str(exc)[:160]})"
    run_engines(engines, tok, 1, hot)  # warm-up: first calls pay one-time costs (allocations, vLLM's graphs)
    rows, _ = run_engines(engines, tok, args.rounds, hot)
    _, same = run_engines({k: engines[k] for k in ("sequential hf", "concurrent hf")}, tok, 2, greedy)
    seq_ids, conc_ids = same["sequential hf"], same["concurrent hf"]

    base = rows[0]
    lines = [f"# Rollout engines on the demo's tasks ({args.rounds} updates' worth, {os.cpu_count()} cores)", "",
             "| engine | rollout wall time | sampled tokens | tokens/s | vs sequential (tokens/s) |",
             "|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r.name} | {r.seconds:.1f} s | {r.tokens} | {r.rate:.0f} | {r.rate / base.rate:.2f}x |"
        for r in rows
    ]
    if vllm_note:
        lines += ["", vllm_note]
    lines += ["", "## Greedy decoding: the same trees", "",
              f"concurrent hf grows the sequential loop's trees: {seq_ids == conc_ids} ({len(seq_ids)} trees)", "",
              "## Prefix cache", "", "| engine | cache hit rate | shared-token fraction of the trees |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {r.name} | {r.cached:.3f} | {r.shared:.3f} |" for r in rows if r.cached is not None]
    if args.demo_updates:
        lines += ["", f"## The demo, {args.demo_updates} updates", "",
                  "| engine | wall time | rollout | last mean reward |", "|---|---|---|---|"]  # fmt: skip
        lines += [demo_wall_time(e, args.demo_updates) for e in ("hf", "vllm")]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
