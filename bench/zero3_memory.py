"""Per-rank parameter bytes during the update window, ZeRO-2 against ZeRO-3, measured on 2 CPU ranks.

A random-init llama of about 29M parameters (fp32, parameters dominate memory), one update of uneven work
(rank 0 one small tree, rank 1 three larger ones). For each stage the same update runs under `torchrun
--nproc_per_node=2`; each rank measures its parameter storage (every full tensor plus, under ZeRO-3, its
partitions) after every parameter all-gather (ZeRO-3), or before the update and at every replay phase
(ZeRO-2, where nothing changes). The ledger's prediction (`model_persistent_bytes`: partition plus the
in-flight bound) is printed beside it, the same numbers `treetrain plan --world-size 2 --zero-stage S`
books.

    python bench/zero3_memory.py [--out bench/out/zero3_memory.md]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from treetrain.bytesize import format_bytes
from treetrain.io import atomic_write_text
from treetrain.memory.persistent import largest_module, model_persistent_bytes
from treetrain.models.presets import TinySize, tiny_model

VOCAB = 4096
SIZE = TinySize(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536)
WORLD = 2


def make_model() -> torch.nn.Module:
    return tiny_model("llama", VOCAB, size=SIZE)


def storage(module: torch.nn.Module) -> int:
    """Parameter bytes held now: full tensors, and ZeRO-3 partitions."""
    total = 0
    for p in module.parameters():
        total += p.data.numel() * p.element_size()
        part = getattr(p, "ds_tensor", None)
        if part is not None:
            total += part.numel() * part.element_size()
    return total


def worker(stage: int, out: Path) -> None:
    from treetrain.distributed import OptimizerConfig, build_placement
    from treetrain.distributed.deepspeed_backend import DeepSpeedBackend
    from treetrain.loss.advantages import AdvantageConfig
    from treetrain.replay.replay_schedule import ReplayHooks
    from treetrain.tree.synthetic import synthetic_group
    from treetrain.update.learner import Learner
    from treetrain.update.run import run_update
    from treetrain.update.settings import ReplaySection, UpdateConfig

    torch.set_num_threads(1)
    backend = DeepSpeedBackend(
        make_model(), zero_stage=stage, optimizer=OptimizerConfig(name="sgd", lr=1e-3), measure_params=True
    )
    adv = AdvantageConfig(zero_variance="keep")
    small = synthetic_group(prefix=8, branches=2, suffix=4, depth=1, vocab=VOCAB, seed=0)
    large = [
        synthetic_group(prefix=48, branches=3, suffix=12, depth=2, vocab=VOCAB, seed=s) for s in (1, 2, 3)
    ]
    trees = [small, *large]
    owned = [
        [set(range(len(t.records))) if r == (0 if i == 0 else WORLD - 1) else set() for r in range(WORLD)]
        for i, t in enumerate(trees)
    ]
    sampled = [storage(backend.module) if stage < 3 else 0]  # ZeRO-2: whole parameters from the start

    def sample(phase: str, step: object) -> None:
        sampled[0] = max(sampled[0], storage(backend.module))

    learner = Learner(backend, hooks=ReplayHooks(step=sample))
    settings = UpdateConfig(advantages=adv, replay=ReplaySection(microbatch=0), mode="tree")
    backend.reset_param_peak()
    run_update(learner, settings, [[t] for t in trees], placement=build_placement(trees, owned, WORLD))
    peak = max(backend.param_peak_bytes, sampled[0])
    sync = backend.rendezvous
    rows = backend.gather(json.dumps({"peak": peak, "rounds": sync.rounds if sync else 0}))
    if backend.rank == 0:
        out.write_text(json.dumps([json.loads(r) for r in rows]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(stage: int, out_dir: Path) -> list[dict[str, int]]:
    out = out_dir / f"zero{stage}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", __file__, "--worker", str(stage), "--json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=1800)
    result: list[dict[str, int]] = json.loads(out.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/zero3_memory.md"))
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.json)
        return
    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        measured = {s: measure(s, Path(scratch)) for s in (2, 3)}
    lines = [
        f"# Per-rank parameter bytes during the update window ({WORLD} CPU ranks, fp32)",
        "",
        f"Model: random-init llama, {n / 1e6:.1f}M parameters ({format_bytes(4 * n)}); largest module "
        f"{format_bytes(4 * largest_module(model))}. Command: `python bench/zero3_memory.py`.",
        "",
        "| ZeRO stage | measured peak, rank 0 | measured peak, rank 1 | predicted (ledger) | "
        "of which in flight (bound) | ZeRO-3 / ZeRO-2 (measured, busiest rank) |",
        "|---|---|---|---|---|---|",
    ]
    busiest = {s: max(r["peak"] for r in measured[s]) for s in measured}
    for s in (2, 3):
        pred = model_persistent_bytes(model, zero_stage=s, world_size=WORLD)
        ratio = f"{busiest[3] / busiest[2]:.3f}" if s == 3 else "1"
        lines.append(
            f"| {s} | {format_bytes(measured[s][0]['peak'])} | {format_bytes(measured[s][1]['peak'])} | "
            f"{format_bytes(pred.params + pred.in_flight)} | {format_bytes(pred.in_flight)} | {ratio} |"
        )
    lines += [
        "",
        f"1/W of ZeRO-2 is {1 / WORLD:.3f}; the rest is the parameters in flight (the module a rank runs and "
        "one gathered for the other rank). Rendezvous rounds under ZeRO-3: "
        + ", ".join(f"rank {i}: {r['rounds']}" for i, r in enumerate(measured[3]))
        + ".",
    ]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
