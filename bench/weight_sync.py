"""Weights into `vllm serve`: the file reload against the stream through vLLM's weight-transfer API (gloo).

Against running servers (`--url`, once per server, each started with the command of
docs/rollout-engines.md, which enables the `treetrain_gloo` backend) on the wide demo model. Each round moves
the trainer's weights (a seeded random step), then syncs them with `rollout.vllm.weight_sync` `files` and
`gloo`, in the order A B B A, each through the `vllm-server` engine a run uses, with everything a run's
sync does: the write and the reload, or the stream; then the prefix-cache reset, the version label and the
probe scored against the trainer. A warm-up sync of each comes first (the stream's first one forms the
transfer group). Reported per method, as the median over `--rounds`:

- seconds per sync, and per MiB of the model's weights;
- the bytes the engine counted per sync: written once (each server then reads them), or streamed to each
  server;
- the sampler/trainer gap on the probe prompt after the sync (float32 rounding when the weights arrived).

    python bench/weight_sync.py --url http://127.0.0.1:8000 --rounds 5 --out bench/out/weight_sync.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from treetrain.benchmark.report import publish
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.server_calls import call_server
from treetrain.rollout.engines.server_checks import Expected, served_prompt_logprobs, trainer_probe
from treetrain.rollout.engines.vllm_server import VLLMServerEngine
from treetrain.train.models import WIDE_DEMO_MODEL

METHODS = ("files", "gloo")


@dataclass(frozen=True)
class Sync:
    """One timed sync."""

    method: str
    seconds: float
    sent: int
    """Bytes the engine counted for it."""
    gap: float
    """Largest |server - trainer| logprob of the probe prompt after it, over the servers."""


def engines(urls: list[str], work: Path) -> dict[str, VLLMServerEngine]:
    want = Expected(path=str(WIDE_DEMO_MODEL), dtype="float32", max_model_len=1024)
    return {
        m: VLLMServerEngine(
            VLLMSettings(urls=tuple(urls), weight_sync=m), weights_dir=work / m, expected=want
        )
        for m in METHODS
    }


def gap(urls: list[str], model: Any) -> float:
    tokens, own = trainer_probe(model)
    worst = 0.0
    for url in urls:
        served = call_server(url, "/v1/models", None, 30)["data"][0]["id"]
        body = {"model": served, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0}
        theirs = served_prompt_logprobs(call_server(url, "/v1/completions", body, 60), tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(own, theirs)))
    return worst


def sync(engine: VLLMServerEngine, method: str, model: Any, version: int, urls: list[str]) -> Sync:
    before = engine.stats.sync_bytes
    start = time.perf_counter()
    engine.sync_weights(model, version)
    seconds = time.perf_counter() - start
    return Sync(method, seconds, engine.stats.sync_bytes - before, gap(urls, model))


def weight_bytes() -> int:
    """The demo model's weights, each tensor once."""
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(urls: list[str], rounds: int, work: Path) -> list[Sync]:
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    each = engines(urls, work)
    gen = torch.Generator().manual_seed(0)
    version = 0
    for method in METHODS:  # warm-up: the first stream forms the transfer group
        sync(each[method], method, model, version, urls)
    out = []
    try:
        for r in range(rounds):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
            order = METHODS if r % 2 == 0 else METHODS[::-1]
            for method in (*order, *order[::-1]):
                version += 1
                out.append(sync(each[method], method, model, version, urls))
    finally:
        for engine in each.values():
            engine.close()
    return out


def report(syncs: list[Sync], servers: int, weights: int, command: str) -> str:
    lines = [
        f"{len(syncs) // len(METHODS)} syncs per method into {servers} server(s), {weights / 2**20:.2f} MiB of "
        f"weights (`{command}`):",
        "",
        "| method | sync s (median) | bytes counted per sync | s per MiB of weights | largest gap after a sync |",
        "|---|---|---|---|---|",
    ]
    median: dict[str, float] = {}
    for method in METHODS:
        mine = [s for s in syncs if s.method == method]
        median[method] = statistics.median(s.seconds for s in mine)
        sent = statistics.median(s.sent for s in mine)
        lines.append(
            f"| {method} | {median[method]:.3f} | {sent:.0f} | {median[method] / (weights / 2**20):.4f} | "
            f"{max(s.gap for s in mine):.1e} |"
        )
    lines += ["", f"gloo/files sync seconds: {median['gloo'] / median['files']:.2f}"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", required=True, help="a running server's base URL (repeat)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each syncing twice per method")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        syncs = run(args.url, args.rounds, Path(work))
    publish(report(syncs, len(args.url), weight_bytes(), " ".join(["python", *sys.argv])), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
