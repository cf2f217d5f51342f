"""`treetrain train` as 2 nodes x 1 process on this machine, and the weight deltas the distributed tests
compare (tests/train/test_train_distributed.py, tests/train/test_async_distributed.py).

Two `torchrun --nnodes=2 --nproc_per_node=1` launchers (one per "node") meet through c10d rendezvous on
127.0.0.1 at a free port and share one run directory, as two machines would on a shared filesystem."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.ports import calibrate_run, free_port, run_all

TIMEOUT_S = 600
DEMO = Path(__file__).parents[2] / "treetrain" / "assets" / "demo_model" / "model.safetensors"


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def delta(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> torch.Tensor:
    """after - before over the tensors both files hold (a checkpoint stores a tied weight once)."""
    keys = sorted(before.keys() & after.keys())
    assert len(keys) >= len(before) - 1, "the files hold different models"
    return torch.cat([(after[k].double() - before[k].double()).reshape(-1) for k in keys])


def two_nodes(run_dir: Path, *args: str) -> None:
    """Run `treetrain train --run-dir RUN_DIR ARGS` as 2 nodes x 1 process: two launchers, one rendezvous
    endpoint, one run directory; a launcher that fails or hangs fails the test with its output. The model's
    memory calibrations are measured here first (`support.ports.calibrate_run`)."""
    calibrate_run([value for flag, value in itertools.pairwise(args) if flag == "--set"])
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    port = free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
    rendezvous = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=treetrain-{port}"]
    train = ["-m", "treetrain", "train", "--run-dir", str(run_dir), "--no-progress", *args]
    cmds = [[*launcher, f"--node_rank={node}", *rendezvous, *train] for node in range(2)]
    for node, done in enumerate(run_all(cmds, env, TIMEOUT_S)):
        if done.returncode is None:
            pytest.fail(
                f"2-node training did not finish in {TIMEOUT_S}s (a deadlock?):\n{done.output[-3000:]}"
            )
        if done.returncode != 0:
            pytest.fail(f"node {node} failed ({done.returncode}):\n{done.output[-6000:]}")


def close_delta(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """`got` equals `want` within 1e-5 relative (fp32 reduction order, measured below 1e-6), and a halved
    update (the negative control) is far outside."""
    scale = float(want.norm())
    assert scale > 0, f"{what}: the single-process update is empty"
    err = float((got - want).norm()) / scale
    print(f"\n{what}: 2-node vs single-process delta {err:.2e} relative")
    assert err < 1e-5, f"{what}: 2-node delta differs from the single-process delta by {err:.2e} (relative)"
    assert float((0.5 * got - want).norm()) / scale > 0.4  # a halved update is far outside
