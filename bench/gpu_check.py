"""The GPU check: a few minutes on one CUDA device for what CPU runs cannot show.

    python bench/gpu_check.py                    # on a machine with CUDA (a few minutes)
    python bench/gpu_check.py --dry-run          # the same steps on CPU with a tiny model (seconds; tests)
    python bench/gpu_check.py --out bench/out/gpu_check.md

Six steps, one table each, written as markdown to stdout and `--out`:

1. exactness: `exact` against flat, in float32 and bfloat16, beside the noise floor measured the same way
   (`treetrain.replay.verify`), for a grouped-query Llama and the sliding-window Mistral;
2. speed: flat, `exact` and `response_only` side by side in bfloat16 (the geometry benchmark's model and
   engine settings, `treetrain.benchmark`), seconds per update and the speedups against flat;
3. memory: each tree mode's peak from the CUDA allocator (`max_memory_allocated`, everything on the device)
   against the ledger's prediction (`predict_ledger`);
4. rollout engines: sampled tokens per second of the `hf` engine and of vLLM in process on the same requests
   (a random-init Llama of about 0.5B parameters in bfloat16: 64 branch points of 8 samples of 128 tokens
   after a shared 512-token prompt), and vLLM's weight-sync seconds per GB;
5. asynchronous training: the demo's update loop with `rollout.max_staleness=1` against 0, interleaved
   (`bench/async_overlap.py`), its wall-time ratio and the trained tokens' lags. It is `treetrain train`
   itself, on the GPU (`device: auto`); a run that fails is a row with its last words;
6. context groups: `treetrain train` under torchrun at `distributed.context_parallel=2` against one process
   and against 2 ranks of C = 1 on a long prompt (`bench/context_runs.py`'s cases, `gpu_cases`), one rank
   per GPU over NCCL: time per update, each rank-0 peak against the per-rank ledger, the bytes that crossed
   against the ledger's, and the float64 step against the one-process step. It needs 2 GPUs (NCCL refuses
   two ranks on one device); with fewer the table says so.

The dry run shrinks every step (one family, one point, float32 speed, the tracker instead of the
allocator, a tiny model and the `hf` engine alone for the rollout step, no context-group launches) so that
it checks the script in seconds.

On CPU without `--dry-run` it refuses to run: its numbers are only meaningful on the device.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from treetrain.benchmark.bench_config import FULL, QUICK, BenchConfig, GridPoint
from treetrain.benchmark.report import publish
from treetrain.benchmark.workload import (
    LOSS,
    bench_batch,
    bench_model,
    make_engine,
    replay_config,
    zero_grads,
)
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.ledger import predict_ledger
from treetrain.models.presets import TinySize, tiny_model
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.verify import deviation, flat_gradient, noise_floor, tree_gradient
from treetrain.tree.synthetic import synthetic_group

SPEED_POINTS = (GridPoint(2048, 8, 64, 1), GridPoint(8192, 8, 64, 1), GridPoint(8192, 8, 512, 1))
DRY_POINTS = (GridPoint(48, 4, 8, 1),)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exactness(device: torch.device, dry: bool) -> list[str]:
    size = TinySize(
        hidden_size=32 if dry else 256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    prefix, suffix = (24, 6) if dry else (1024, 64)
    tree = synthetic_group(prefix=prefix, branches=4, suffix=suffix, depth=2, vocab=64, seed=0)
    loss = LossConfig()
    adv = compute_advantages([tree], AdvantageConfig(zero_variance="keep"))
    batch = UpdateBatch.build([tree], adv.trees, loss)
    lines = [
        "| family | dtype | exact vs flat (abs) | noise floor (abs) | ratio | within 5x floor |",
        "|---|---|---|---|---|---|",
    ]
    for family in ("llama",) if dry else ("llama", "mistral"):
        for dtype in (torch.float32, torch.bfloat16):

            def make(family: str = family, dtype: torch.dtype = dtype) -> torch.nn.Module:
                return tiny_model(family, 64, size=size, dtype=dtype, seed=1).to(device)

            floor = noise_floor(make, batch, loss)
            dev = deviation(
                tree_gradient(make(), batch, loss, ReplayConfig(microbatch=2, chunk_size=prefix // 3)),
                flat_gradient(make(), batch, loss),
            )
            ratio = dev.abs / floor if floor > 0 else float("inf")
            ok = "yes" if dev.abs <= 5 * floor else "NO"
            lines.append(
                f"| {family} | {str(dtype)[6:]} | {dev.abs:.3e} | {floor:.3e} | {ratio:.2f} | {ok} |"
            )
    return lines


def _update(
    model: torch.nn.Module, batch: object, mode: str, cfg: BenchConfig, device: torch.device
) -> float:
    engine = make_engine(model, mode, cfg)  # type: ignore[arg-type]
    zero_grads(model)
    _sync(device)
    start = time.perf_counter()
    engine.accumulate(batch)  # type: ignore[arg-type]
    _sync(device)
    return time.perf_counter() - start


def speed_and_memory(device: torch.device, dry: bool) -> tuple[list[str], list[str]]:
    base = QUICK if dry else FULL
    cfg = replace(base, model=replace(base.model, dtype="float32" if dry else "bfloat16"))
    reps = 1 if dry else 2
    model = bench_model(cfg.model).to(device)
    zero_grads(model)
    speed = [
        "| P | G | S | d | flat s | exact s | exact × | resp-only s | resp-only × |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    memory = [
        "| P | G | S | d | mode | measured peak MiB | ledger MiB | measured / ledger |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in DRY_POINTS if dry else SPEED_POINTS:
        batch = bench_batch(p, cfg)
        seconds = {}
        for mode in ("flat", "exact", "response_only"):
            _update(model, batch, mode, cfg, device)  # warm-up
            seconds[mode] = min(_update(model, batch, mode, cfg, device) for _ in range(reps))
        f = seconds["flat"]
        speed.append(
            f"| {p.prefix} | {p.branches} | {p.suffix} | {p.depth} | {f:.3g} | {seconds['exact']:.3g} | "
            f"{f / seconds['exact']:.2f} | {seconds['response_only']:.3g} | {f / seconds['response_only']:.2f} |"
        )
        for mode in ("exact", "response_only"):
            predicted = predict_ledger(batch, model, replay_config(mode, cfg), LOSS).peak.total  # type: ignore[arg-type]
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                _update(model, batch, mode, cfg, device)
                measured = torch.cuda.max_memory_allocated(device)
            else:  # dry run: the tracker's live tensor bytes stand in for the allocator
                from treetrain.benchmark.memory import measure_peak

                measured = measure_peak(model, batch, mode, cfg).total  # type: ignore[arg-type]
            memory.append(
                f"| {p.prefix} | {p.branches} | {p.suffix} | {p.depth} | {mode} | {measured / 2**20:.1f} | "
                f"{predicted / 2**20:.1f} | {measured / max(1, predicted):.2f} |"
            )
    return speed, memory


def _generate(engine: object, requests: list[object]) -> tuple[int, float]:
    """Sampled tokens and seconds for `requests` on `engine`, all submitted at once."""
    start = time.perf_counter()
    for request in requests:
        engine.submit(request)  # type: ignore[attr-defined]
    tokens = 0
    while engine.busy:  # type: ignore[attr-defined]
        tokens += sum(len(c.tokens) for r in engine.poll() for c in r.completions)  # type: ignore[attr-defined]
    return tokens, time.perf_counter() - start


def rollout_engines(device: torch.device, dry: bool) -> list[str]:
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    from treetrain.rollout.engines.generation import GenerationRequest
    from treetrain.rollout.engines.hf_engine import HFEngine
    from treetrain.rollout.sampling import Sampling

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1)
    if not dry:
        size = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)
    torch.manual_seed(0)
    dtype = torch.float32 if dry else torch.bfloat16
    config = LlamaConfig(vocab_size=32000, num_key_value_heads=size["num_attention_heads"], **size)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    prompt, points, n, new = (64, 4, 2, 8) if dry else (512, 64, 8, 128)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 32000, (prompt,), generator=gen).tolist()

    def requests() -> list[object]:
        return [
            GenerationRequest((*shared, 3 + i), n, new, Sampling(), ((2,),), seed=i, group="g")
            for i in range(points)
        ]

    params_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    rows = ["| engine | sampled tokens | seconds | tokens/s | weight sync s/GB |", "|---|---|---|---|---|"]
    _generate(HFEngine(model), requests()[:1])  # warm-up
    tokens, seconds = _generate(HFEngine(model), requests())
    rows.append(f"| hf | {tokens} | {seconds:.2f} | {tokens / seconds:.0f} | - |")
    if dry:
        rows.append("| vllm | not run in the dry run | | | |")
        return rows
    from treetrain.rollout.engines.engine_settings import VLLMSettings
    from treetrain.rollout.engines.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as where:
        model.save_pretrained(where)
        engine = VLLMEngine(where, VLLMSettings(gpu_memory_utilization=0.3), dtype="bfloat16",
                            max_model_len=prompt + new + 8)  # fmt: skip
        _generate(engine, requests()[:1])
        tokens, seconds = _generate(engine, requests())
        sync = time.perf_counter()
        engine.sync_weights(model, 1)
        per_gb = (time.perf_counter() - sync) / params_gb
        engine.close()
    rows.append(f"| vllm | {tokens} | {seconds:.2f} | {tokens / seconds:.0f} | {per_gb:.2f} |")
    return rows


def async_training(dry: bool) -> list[str]:
    """The demo with `rollout.max_staleness=1` against 0, side by side (`bench/async_overlap.py`)."""
    import tempfile

    overlap = _bench_script("async_overlap")
    updates = 2 if dry else 8
    with tempfile.TemporaryDirectory() as tmp:
        try:
            runs = [
                overlap.train("hf", k, updates, Path(tmp) / f"{i}")
                for i, k in enumerate((0, 1) if dry else (0, 1, 1, 0))
            ]
        except SystemExit as exc:  # the first `treetrain train` on this device: the other tables stay
            return [f"failed: {' '.join(str(exc).split())[-1500:]}"]
    return overlap.report(runs, updates, "python bench/gpu_check.py").splitlines()


def _bench_script(name: str) -> Any:
    """A sibling script of bench/ as a module (registered, so its dataclasses find their module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def context_groups(dry: bool, devices: int) -> list[str]:
    """`bench/context_runs.py`'s GPU cases on `devices` GPUs: P = 16000 (its model holds 16,384 positions),
    two groups of four answers."""
    import tempfile

    runs = _bench_script("context_runs")
    if dry:
        return ["not run in the dry run: its cases are `treetrain train` launches, which "
                "`bench/context_runs.py` runs on the CPU"]  # fmt: skip
    cases = runs.gpu_cases(devices)
    if not cases:
        return [f"not run: a context group of 2 needs 2 GPUs, one per rank (NCCL refuses two ranks on one "
                f"device), and this machine has {devices}"]  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        try:
            rows = runs.run_cases(cases, Path(scratch), prompt_tokens=16000, groups=2)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            return [f"failed: {' '.join(str(exc).split())[-1500:]}"]
    return runs.table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny model on CPU: check the script, not the GPU"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here (markdown)")
    args = parser.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("gpu_check: no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    start = time.perf_counter()
    name = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    lines = [f"# GPU check on {name}, torch {torch.__version__}", ""]
    lines += ["## exact vs flat against the noise floor", "", *exactness(device, args.dry_run), ""]
    speed, memory = speed_and_memory(device, args.dry_run)
    dtype = "float32" if args.dry_run else "bfloat16"
    lines += [
        f"## speed ({dtype}; seconds per update, best of the repetitions after a warm-up)",
        "",
        *speed,
        "",
    ]
    lines += [f"## peak memory against the ledger ({dtype})", "", *memory, ""]
    lines += [f"## rollout engines ({dtype})", "", *rollout_engines(device, args.dry_run), ""]
    lines += ["## asynchronous training (the demo, hf)", "", *async_training(args.dry_run), ""]
    devices = 0 if args.dry_run else torch.cuda.device_count()
    lines += ["## context groups (`treetrain train`, C = 2)", "", *context_groups(args.dry_run, devices), ""]
    lines.append(f"wall time {time.perf_counter() - start:.0f} s")
    publish("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
