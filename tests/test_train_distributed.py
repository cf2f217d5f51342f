"""`treetrain train` under torchrun with 2 ranks and DeepSpeed ZeRO-2 makes the single-process update.

The whole trainer runs (rollouts split over ranks and exchanged, planning, the update window, the step,
checkpoint and export) on the shipped demo checkpoint. Both runs sample the same trees (per-task seeds),
so the first update's parameter delta must agree. The optimizer is SGD, so the delta is -lr * g and its
scale is checked too. The tolerance is relative to the delta: the two runs differ only in the order of
fp32 reductions and the gradient-norm clip (measured 7e-7 relative); the negative control is a delta of the
wrong scale.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port
from safetensors.torch import load_file

from treetrain.cli.main import main
from treetrain.train.metrics import read_metrics

pytestmark = pytest.mark.distributed
TIMEOUT_S = 480
SETTINGS = [
    "--set", "optim.name=sgd", "--set", "optim.lr=0.5", "--set", "rollout.groups_per_update=2",
    "--set", "threads=1", "--set", "measure_memory_every=0", "--set", "checkpoint_every=1",
]  # fmt: skip
DEMO = Path(__file__).parents[1] / "treetrain" / "assets" / "demo_model" / "model.safetensors"


def _delta(run_dir: Path) -> torch.Tensor:
    before, after = load_file(str(DEMO)), load_file(str(run_dir / "final" / "model.safetensors"))
    return torch.cat([(after[k].double() - before[k].double()).reshape(-1) for k in sorted(before)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("train_distributed")
    single, ranks = base / "single", base / "ranks"
    assert main(["train", "--run-dir", str(single), "--no-progress", "--updates", "1", *SETTINGS]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", "-m", "treetrain", "train", "--run-dir", str(ranks), "--no-progress",
        "--updates", "1", *SETTINGS, "--set", "distributed.backend=deepspeed", "--set", "distributed.zero_stage=2",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S}s: {str(exc.stdout)[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return single, ranks


def test_two_rank_deepspeed_training_makes_the_single_process_update(runs: tuple[Path, Path]) -> None:
    single, ranks = runs
    a, b = read_metrics(single / "metrics.jsonl"), read_metrics(ranks / "metrics.jsonl")
    assert len(a) == len(b) == 1
    assert (a[0].reward_mean, a[0].trajectories, a[0].groups) == (
        b[0].reward_mean,
        b[0].trajectories,
        b[0].groups,
    )
    assert a[0].groups - a[0].groups_dropped > 0, "no group trained: the comparison would be vacuous"
    d_single, d_ranks = _delta(single), _delta(ranks)
    scale = float(d_single.norm())
    assert scale > 0
    err = float((d_ranks - d_single).norm()) / scale
    print(f"\n2-rank vs single-process delta: {err:.2e} relative")
    assert err < 1e-5, f"2-rank delta differs from the single-process delta by {err:.2e} (relative)"
    assert float((0.5 * d_ranks - d_single).norm()) / scale > 0.4  # a halved update is far outside


def test_two_rank_run_leaves_a_resumable_checkpoint_and_an_export(runs: tuple[Path, Path]) -> None:
    _, ranks = runs
    assert (ranks / "final" / "config.json").is_file() and (ranks / "summary.txt").is_file()
    assert sorted(p.name for p in (ranks / "checkpoints").iterdir()) == ["update-00001"]
