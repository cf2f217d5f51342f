"""`treetrain train` in a context group, end to end: two ranks under torchrun (gloo, DeepSpeed) with
`distributed.context_parallel=2` hold one prompt's resident state between them.

- A prompt whose resident state one rank cannot hold within `memory_budget` is refused at C = 1 with the C
  it needs, trains at C = 2 under the same budget (float64, ZeRO 0), and the update equals the one-process
  update made without a budget, within FACTOR times the one-process noise floor: its tree update against
  its flat one (Hugging Face models keep float32 islands in float64, so the floor is theirs). The group's
  rank measures its live peak against the per-rank ledger.
- `mode=flat` in a group (nothing resident to shard) is the one-process flat update; LoRA with a KL
  term against the adapters-off policy gives the one-process adapters, and a full fine-tune with a KL term
  against a reference model of its own the one-process weights, its resident state sharded too.
- Wherever a group exchanges, the bytes each rank put into the collectives (`context_bytes`) are the
  per-rank ledger's prediction (`context_bytes_predicted`) to the byte.
- A rank killed with SIGKILL in the middle of an update stops the group: torchrun stops the other rank,
  which says so in one line; `--resume` redoes the update, and the run ends with every update once and the
  one-process weights.
- The built-in long-context environment (`longdoc`) samples and trains in the group, and its first update
  is the one-process update.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.ports import stalling_ranks, train_ranks

from treetrain.benchmark.long_prompt import write_long_model, write_long_rollouts
from treetrain.cli.main import main
from treetrain.train.config import load_config
from treetrain.train.loop import Trainer
from treetrain.train.metrics import read_metrics
from treetrain.tree.format import load_tree

pytestmark = pytest.mark.distributed

SGD = ["optim.name=sgd", "optim.lr=0.5", "optim.grad_clip=0"]  # one step is exactly -lr * g
FACTOR = 5.0
GROUP = ["distributed.backend=deepspeed", "distributed.context_parallel=2"]
BUDGET = "memory_budget=64MiB"  # float64: one rank's smallest peak is about 74 MiB, a rank of a group of 2 about 60


def _sets(settings: list[str]) -> list[str]:
    return [a for kv in settings for a in ("--set", kv)]


def _torchrun(run_dir: Path, settings: list[str], *extra: str) -> None:
    done = train_ranks(run_dir, [*settings, *GROUP], *extra, timeout=600)
    assert done.returncode == 0, done.output[-3000:]


def _same_step(a: torch.Tensor, b: torch.Tensor) -> None:
    """`b` is the step `a` within 1e-5 relative (fp32), and a step 10% short is caught (the control)."""
    assert float((a - b).norm()) <= 1e-5 * float(a.norm())
    assert float((a - 0.9 * b).norm()) > 1e-5 * float(a.norm())


def _update(run_dir: Path, start: dict[str, torch.Tensor]) -> torch.Tensor:
    """The step the run took: its final weights minus `start`, flattened (float64)."""
    end = load_file(run_dir / "final" / "model.safetensors")
    return torch.cat([(end[k].double() - start[k].double()).flatten() for k in sorted(start)])


def test_a_prompt_one_rank_cannot_hold_trains_in_a_group_of_two(tmp_path: Path, capsys) -> None:
    model = write_long_model(tmp_path / "model")
    write_long_rollouts(tmp_path / "long.jsonl", prompt_tokens=8000)
    assert main(["import", str(tmp_path / "long.jsonl"), "--out", str(tmp_path / "trees")]) == 0
    settings = [f"model.path={model}", "model.dtype=float64", "rollout.groups_per_update=1", "updates=1",
                "checkpoint_every=0", *SGD]  # fmt: skip
    trees = ["--trees", str(tmp_path / "trees")]
    one = ["train", "--no-progress", *trees, *_sets([*settings, "measure_memory_every=0"])]

    capsys.readouterr()
    assert main([*one, "--run-dir", str(tmp_path / "refused"), "--set", BUDGET]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing fits the 64.0 MiB budget" in err, err
    assert "needs distributed.context_parallel >= 2" in err, err

    assert main([*one, "--run-dir", str(tmp_path / "one")]) == 0
    assert main([*one, "--run-dir", str(tmp_path / "flat"), "--set", "mode=flat"]) == 0
    _torchrun(
        tmp_path / "two", [*settings, BUDGET, "distributed.zero_stage=0", "measure_memory_every=1"], *trees
    )

    start = load_file(model / "model.safetensors")
    a, b = _update(tmp_path / "one", start), _update(tmp_path / "two", start)
    floor = float((a - _update(tmp_path / "flat", start)).norm())
    assert float(a.norm()) > 1e-2 and 0 < floor < 1e-6 * float(a.norm())  # float64's floor, not float32's
    err = float((a - b).norm())
    print(
        f"\nC=2 vs one process, float64: {err:.2e} (floor {floor:.2e}, relative {err / float(a.norm()):.2e})"
    )
    assert err <= FACTOR * floor
    assert float((a - 0.999 * b).norm()) > FACTOR * floor  # the control: a step 0.1% short is caught
    (row_one,) = read_metrics(tmp_path / "one" / "metrics.jsonl")
    (row,) = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert row.context_bytes > 0 and row_one.context_bytes == 0
    assert row.context_bytes == row.context_bytes_predicted  # the per-rank ledger's transfers, to the byte
    assert row.flat_token_cost == row_one.flat_token_cost  # one data group: the whole update's flat cost
    assert row.peak_bytes is not None and row.predicted_peak_bytes > 0
    assert row.peak_bytes <= 64 * 2**20
    assert abs(row.peak_bytes / row.predicted_peak_bytes - 1) <= 0.10, (
        row.peak_bytes,
        row.predicted_peak_bytes,
    )


def _stall_and_kill(run_dir: Path, group: list[str], trees: Path, tmp_path: Path) -> tuple[int | None, str]:
    """Start the group under torchrun with rank 1 standing still once update 1 has taken its trees (rank 0
    goes on into the update's collectives), SIGKILL rank 1 there, and return torchrun's exit code and
    output."""
    arrived, log = tmp_path / "arrived", tmp_path / "torchrun.log"
    args = ["train", "--run-dir", str(run_dir), "--no-progress", "--trees", str(trees), *_sets(group)]
    code: int | None = None
    with stalling_ranks("update-start@1#1", arrived, args, log) as proc:
        time.sleep(1.0)  # rank 0 waits in the update's first collective
        os.kill(int(arrived.read_text()), signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = proc.wait(timeout=120)
    return code, log.read_text()


@pytest.fixture(scope="module")
def three_groups(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A checkpoint and three imported groups, each of one 2000-token prompt (one group per update)."""
    work = tmp_path_factory.mktemp("three_groups")
    model, trees = write_long_model(work / "model"), work / "trees"
    for g in range(3):
        jsonl = write_long_rollouts(work / f"g{g}.jsonl", prompt_tokens=2000, seed=g)
        assert main(["import", str(jsonl), "--out", str(trees / f"g{g}")]) == 0
    return model, trees


def test_flat_mode_in_a_group_is_the_one_process_update(
    three_groups: tuple[Path, Path], tmp_path: Path
) -> None:
    """`mode=flat` replays every trajectory whole: there is no resident state to shard, so the group sends
    nothing, and its update is the one-process flat update."""
    model, trees = three_groups
    settings = [f"model.path={model}", "rollout.groups_per_update=1", "updates=1", "checkpoint_every=0",
                "measure_memory_every=0", "mode=flat", *SGD]  # fmt: skip
    assert main(["train", "--no-progress", "--trees", str(trees), "--run-dir", str(tmp_path / "one"),
                 *_sets(settings)]) == 0  # fmt: skip
    _torchrun(tmp_path / "two", settings, "--trees", str(trees))
    rows = [read_metrics(tmp_path / run / "metrics.jsonl")[0] for run in ("one", "two")]
    assert [r.mode for r in rows] == ["flat", "flat"] and [r.context_bytes for r in rows] == [0, 0]
    start = load_file(model / "model.safetensors")
    a, b = _update(tmp_path / "one", start), _update(tmp_path / "two", start)
    assert float(a.norm()) > 1e-2
    _same_step(a, b)  # measured 1.8e-7


def test_lora_with_a_kl_reference_in_a_group_is_the_one_process_update(
    three_groups: tuple[Path, Path], tmp_path: Path
) -> None:
    """LoRA adapters with the KL term against the policy with its adapters off (`model.reference=base`):
    the reference is scored through the same sharded state, and two updates (the second one with a nonzero
    KL) give the one-process adapters."""
    model, trees = three_groups
    settings = [f"model.path={model}", "rollout.groups_per_update=1", "updates=2", "checkpoint_every=0",
                "measure_memory_every=0", "model.lora.r=8", "loss.kl_coef=0.1", "model.reference=base",
                *SGD]  # fmt: skip
    assert main(["train", "--no-progress", "--trees", str(trees), "--run-dir", str(tmp_path / "one"),
                 *_sets(settings)]) == 0  # fmt: skip
    _torchrun(tmp_path / "two", settings, "--trees", str(trees))
    one, two = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("one", "two"))
    assert one[1].kl > 0 and two[1].kl == pytest.approx(one[1].kl, rel=1e-4)  # the KL term is live
    assert two[0].context_bytes > 0  # the group's own path, not a replicated one
    assert [r.context_bytes for r in two] == [r.context_bytes_predicted for r in two]  # the reference's too
    a, b = (load_file(tmp_path / run / "final" / "adapter_model.safetensors") for run in ("one", "two"))
    keys = sorted(k for k in a if "lora_B" in k)  # B starts at zero: its weights are the two steps
    da, db = (torch.cat([w[k].double().flatten() for k in keys]) for w in (a, b))
    assert keys and float(da.norm()) > 1e-2
    _same_step(da, db)  # measured 4.1e-7


def test_a_separate_reference_model_in_a_group_is_the_one_process_update(
    three_groups: tuple[Path, Path], tmp_path: Path
) -> None:
    """A reference model of its own (`model.reference=PATH`, scored in a walk of its own after the policy's)
    keeps its resident state sharded like the policy's: the bytes the group exchanges are the per-rank
    ledger's, which prices the reference's walk sharded, and two updates (the second with a nonzero KL) give
    the one-process weights."""
    model, trees = three_groups
    settings = [f"model.path={model}", "rollout.groups_per_update=1", "updates=2", "checkpoint_every=0",
                "measure_memory_every=0", "loss.kl_coef=0.1", f"model.reference={model}", *SGD]  # fmt: skip
    assert main(["train", "--no-progress", "--trees", str(trees), "--run-dir", str(tmp_path / "one"),
                 *_sets(settings)]) == 0  # fmt: skip
    _torchrun(tmp_path / "two", settings, "--trees", str(trees))
    one, two = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("one", "two"))
    assert one[1].kl > 0 and two[1].kl == pytest.approx(one[1].kl, rel=1e-4)
    assert all(r.context_bytes > 0 for r in two)
    assert [r.context_bytes for r in two] == [r.context_bytes_predicted for r in two]
    start = load_file(model / "model.safetensors")
    a, b = _update(tmp_path / "one", start), _update(tmp_path / "two", start)
    assert float(a.norm()) > 1e-2
    _same_step(a, b)


def test_a_rank_killed_mid_update_stops_the_group_and_resume_redoes_it(
    three_groups: tuple[Path, Path], tmp_path: Path
) -> None:
    model, trees = three_groups
    settings = [f"model.path={model}", "rollout.groups_per_update=1", "updates=3", "checkpoint_every=1",
                "measure_memory_every=0", *SGD]  # fmt: skip
    assert main(["train", "--no-progress", "--trees", str(trees), "--run-dir", str(tmp_path / "one"),
                 *_sets(settings)]) == 0  # fmt: skip

    run = tmp_path / "two"
    code, output = _stall_and_kill(run, [*settings, *GROUP], trees, tmp_path)
    assert code not in (0, None), output[-3000:]  # stopped, and not hung
    said = [line for line in output.splitlines() if line.startswith("treetrain train:")]
    assert len(said) == 1 and "--resume" in said[0], output[-3000:]  # rank 0's one line
    assert (
        "site-packages/treetrain" not in output and "treetrain/train/" not in output
    )  # no traceback of ours
    assert [r.update for r in read_metrics(run / "metrics.jsonl")] == [0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["update-00001"]

    _torchrun(run, settings, "--trees", str(trees), "--resume")
    assert [r.update for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]  # none lost, none doubled
    start = load_file(model / "model.safetensors")
    a, b = _update(tmp_path / "one", start), _update(run, start)
    assert float(a.norm()) > 1e-2
    _same_step(a, b)  # one update at C = 2 measured 5.4e-7


def test_longdoc_samples_and_trains_in_a_group_of_two(tmp_path: Path) -> None:
    settings = [
        "model.path=tiny-llama", "env.name=longdoc", "env.kwargs.num_tokens=600", "rollout.groups_per_update=2",
        "rollout.fanout.root=4", "rollout.episode.max_turns=2", "rollout.episode.max_turn_tokens=12",
        "rollout.episode.max_episode_tokens=2048", "advantages.zero_variance=keep", "loss.entropy_coef=0.01",
        "updates=1", "measure_memory_every=0", "checkpoint_every=0", *SGD,
    ]  # fmt: skip
    single = Trainer(load_config(None, [*settings, f"run_dir={tmp_path / 'one'}"]), progress=False)
    start = {k: v.detach().clone() for k, v in single.backend.module.state_dict().items()}
    single.run()
    _torchrun(tmp_path / "two", [*settings, "distributed.zero_stage=3"])
    (row_one,) = read_metrics(tmp_path / "one" / "metrics.jsonl")
    (row,) = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert row.trajectories == row_one.trajectories == 8 and row.context_bytes > 0
    assert row.context_bytes == row.context_bytes_predicted
    assert row.flat_token_cost == row_one.flat_token_cost
    trees = [load_tree(p) for p in sorted((tmp_path / "two" / "rollouts").rglob("*.msgpack"))]
    assert len(trees) == 2 and min(len(t.nodes[1].tokens) for t in trees) >= 500  # long-prompt trees

    a, b = _update(tmp_path / "one", start), _update(tmp_path / "two", start)
    assert float(a.norm()) > 0
    assert float((a - b).norm()) <= 1e-3 * float(a.norm())  # an entropy-only step: measured 6e-5 (fp32)
