"""Held-out evaluation: pass@k against enumeration, held-out tasks never trained on, eval rows in
metrics.jsonl, and a real run (the demo model on the shipped task file) evaluated during training and
afterwards by `treetrain eval`, which must agree."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest

from treetrain.cli.main import main
from treetrain.errors import ConfigError
from treetrain.rollout.sources.run_settings import task_seeds
from treetrain.train.config import SEED_LIMIT, load_config
from treetrain.train.evaluation import Scores, gather_scores
from treetrain.train.held_out import EVAL_SEED_BASE, check_disjoint, held_out_tasks, pass_at_k
from treetrain.train.metrics import EvalMetrics, MetricsWriter, read_evals, read_metrics

pytestmark = pytest.mark.launch  # end-to-end runs: each starts its environment worker processes

ASSET = str(Path(__file__).resolve().parents[1] / "assets" / "tasks.jsonl")


def _enumerated(n: int, c: int, k: int) -> float:
    """pass@k by listing every k-subset of n samples (c of them passing)."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    worst = 0.0
    biased_differs = False
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                worst = max(worst, abs(pass_at_k(n, c, k) - _enumerated(n, c, k)))
                biased_differs |= abs(1 - (1 - c / n) ** k - _enumerated(n, c, k)) > 1e-3
    assert worst < 1e-12  # float rounding of the product
    assert biased_differs  # negative control: the plug-in estimate 1 - (1 - c/n)^k is biased
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_scores_become_one_row() -> None:
    scores = Scores(((1.0, 0.0, 0.0, 1.0), (0.0, 0.0, 0.0, 0.0), (1.0, 1.0, 0.5, 1.0)), failed_tasks=1)
    row = scores.metrics(update=3, version=3, threshold=1.0, seconds=0.5, greedy=False)
    assert (row.tasks, row.samples, row.failed_tasks) == (3, 4, 1)
    assert row.pass_at_1 == pytest.approx((2 / 4 + 0 + 3 / 4) / 3)
    assert row.pass_at_k == pytest.approx(2 / 3)
    assert row.reward_mean == pytest.approx(5.5 / 12)
    parts = gather_scores(lambda text: [text, text], scores)  # two ranks with the same tasks
    assert len(parts.rewards) == 6 and parts.failed_tasks == 2


def test_held_out_seeds_are_never_training_seeds() -> None:
    held = held_out_tasks("calculator", {}, 8)
    assert held.seeds == tuple(range(EVAL_SEED_BASE, EVAL_SEED_BASE + 8))
    cfg = load_config(None, [f"seed={SEED_LIMIT - 1}", "updates=100000", "eval.every=10"])
    last = task_seeds(cfg, cfg.updates - 1)[-1]
    assert last < min(held.seeds)
    check_disjoint(cfg)
    huge = load_config(None, ["updates=5000000000000000", "eval.every=1"])
    with pytest.raises(ConfigError, match="held-out seeds"):
        check_disjoint(huge)


def test_a_dataset_is_evaluated_on_its_held_out_split() -> None:
    held = held_out_tasks("dataset", {"path": ASSET, "eval_fraction": 0.25}, 100)
    assert held.seeds == (0, 1, 2) and held.kwargs["split"] == "eval"
    with pytest.raises(ConfigError, match="no held-out rows"):
        held_out_tasks("dataset", {"path": ASSET}, 4)


def _eval_row(update: int) -> EvalMetrics:
    return EvalMetrics(update, update, 4, 1, 0.5, 0.5, 0.5)


def test_eval_rows_live_beside_update_rows(tmp_path: Path) -> None:
    from treetrain.train.metrics import UpdateMetrics

    def update_row(i: int) -> UpdateMetrics:
        return UpdateMetrics(
            i,
            i + 1,
            0.5,
            0.1,
            8,
            1,
            0,
            0.1,
            0.1,
            0.0,
            0.0,
            0.0,
            "tree",
            "exact",
            1,
            1,
            3,
            3,
            1.0,
            1.0,
            None,
            0,
        )

    writer = MetricsWriter(tmp_path)
    writer.write_eval(_eval_row(0))
    for i in range(4):
        writer.write(update_row(i))
        if (i + 1) % 2 == 0:
            writer.write_eval(_eval_row(i + 1))
    writer.close()
    path = tmp_path / "metrics.jsonl"
    assert [r.update for r in read_metrics(path)] == [0, 1, 2, 3]
    assert [e.update for e in read_evals(path)] == [0, 2, 4]
    assert all(json.loads(line).get("kind") in (None, "eval") for line in path.read_text().splitlines())
    MetricsWriter(tmp_path, truncate_after=3).close()  # a resume from the checkpoint after update 3
    assert [r.update for r in read_metrics(path)] == [0, 1, 2]
    assert [e.update for e in read_evals(path)] == [0, 2]
    kinds = [json.loads(line).get("kind", "update") for line in path.read_text().splitlines()]
    assert kinds == ["eval", "update", "update", "eval", "update"]


def test_eval_settings_are_checked_at_load() -> None:
    for override, field in (
        ("eval.tasks=0", "eval.tasks"),
        ("eval.samples=4", "eval.samples"),
        ("eval.every=-2", "eval.every"),
        ("eval.pass_threshold=nan", "eval.pass_threshold"),
    ):
        with pytest.raises(ConfigError, match=re.escape(field)):
            load_config(None, [override])
    with pytest.raises(ConfigError, match=r"rollout\.trees"):
        load_config(None, ["eval.every=5", "rollout.trees=trees"])


TRAIN = [
    "--no-progress", "--set", "updates=2", "--set", "rollout.groups_per_update=2", "--set", "rollout.fanout.root=2",
    "--set", "measure_memory_every=0", "--set", "threads=1", "--set", "env.name=dataset",
    "--set", f"env.kwargs.path={ASSET}", "--set", "env.kwargs.eval_fraction=0.25",
    "--set", "env.kwargs.tools=envs.calculator:CalculatorEnv", "--set", "eval.every=1",
]  # fmt: skip
EVAL = [
    "--env", "dataset", "--set", f"env.kwargs.path={ASSET}", "--set", "env.kwargs.eval_fraction=0.25",
    "--set", "env.kwargs.tools=envs.calculator:CalculatorEnv", "--set", "threads=1", "--json",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two updates of the demo model on the shipped task file, evaluated before, after each update."""
    run = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", "--run-dir", str(run), *TRAIN]) == 0
    return run


@pytest.mark.timeout(600)
def test_training_writes_eval_rows_and_draws_them(trained: Path) -> None:
    evals = read_evals(trained / "metrics.jsonl")
    assert [e.update for e in evals] == [0, 1, 2]
    assert all(e.tasks == 3 and e.samples == 1 and e.greedy for e in evals)
    assert all(math.isfinite(e.reward_mean) and 0 <= e.pass_at_1 <= 1 for e in evals)
    assert len(read_metrics(trained / "metrics.jsonl")) == 2
    assert (trained / "reward.png").stat().st_size > 0
    assert len(list((trained / "eval" / "update-00002" / "trees").glob("*.msgpack"))) == 3


@pytest.mark.timeout(600)
def test_evaluation_never_changes_training(trained: Path, tmp_path: Path) -> None:
    """The same run without evaluations makes the same updates: evaluation draws from its own generators."""
    plain = tmp_path / "plain"
    assert main(["train", "--run-dir", str(plain), *TRAIN, "--set", "eval.every=0"]) == 0
    assert not read_evals(plain / "metrics.jsonl")
    with_eval, without = read_metrics(trained / "metrics.jsonl"), read_metrics(plain / "metrics.jsonl")
    assert [(r.reward_mean, r.loss, r.trajectories) for r in with_eval] == [
        (r.reward_mean, r.loss, r.trajectories) for r in without
    ]
    assert any(r.loss != 0 for r in without)  # an update that stepped: equal losses are not two zeros


@pytest.mark.timeout(600)
def test_treetrain_eval_agrees_with_the_runs_last_evaluation(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last = read_evals(trained / "metrics.jsonl")[-1]
    assert 0 < last.pass_at_1 < 1  # the demo solves some held-out tasks, not all: agreement means something
    capsys.readouterr()
    runs = [(trained / "final", EVAL), (trained / "checkpoints" / "update-00002", EVAL)]
    runs.append((trained / "final", ["--env", "dataset", "--json"]))  # the run's own env settings
    for model, argv in runs:
        assert main(["eval", "--model", str(model), *argv]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (out["tasks"], out["samples"], out["update"]) == (3, 1, 2), model
        # greedy decoding of the same weights on the same tasks: the same rewards
        assert out["reward_mean"] == last.reward_mean and out["pass_at_1"] == last.pass_at_1, model
