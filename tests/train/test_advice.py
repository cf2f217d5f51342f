"""The one-time advice for a run without learning signal, and when environment failures stop a run."""

from __future__ import annotations

from dataclasses import replace

from envs.remote import EnvError
from treetrain.rollout.sources.env_failures import TaskFailure, too_many
from treetrain.train.advice import NO_SIGNAL_STREAK, no_signal_advice
from treetrain.train.metrics import UpdateMetrics

IDLE = UpdateMetrics(
    update=0, version=0, reward_mean=0.0, reward_std=0.0, trajectories=8, groups=2, groups_dropped=2, loss=0.0,
    pg=0.0, kl=0.0, entropy=0.0, clipped=0.0, mode="none", contract="exact", graph_tokens=0, nograd_tokens=0,
    flat_token_cost=0, token_cost=0, rollout_seconds=1.0, train_seconds=0.0, peak_bytes=0, predicted_peak_bytes=0,
)  # fmt: skip
STEPPED = replace(IDLE, mode="tree", groups_dropped=0, reward_std=0.4, flat_token_cost=900, token_cost=300)


def _advice_at(rows: list[UpdateMetrics]) -> list[int]:
    """The updates at which the advice is given, feeding the rows one at a time."""
    return [i for i in range(len(rows)) if no_signal_advice(rows[: i + 1]) is not None]


def test_advice_comes_once_after_a_streak_of_updates_without_a_step() -> None:
    rows = [replace(IDLE, update=i) for i in range(10)]
    assert _advice_at(rows) == [NO_SIGNAL_STREAK - 1]
    text = no_signal_advice(rows[:NO_SIGNAL_STREAK])
    assert text is not None and "rollout.fanout.root" in text and "partial rewards" in text
    assert "mean reward 0" in text and "no tokens are saved" in text


def test_a_step_breaks_the_streak_and_a_later_streak_is_not_repeated() -> None:
    pattern = [IDLE, IDLE, STEPPED, IDLE, IDLE, IDLE, STEPPED, IDLE, IDLE, IDLE]
    rows = [replace(r, update=i) for i, r in enumerate(pattern)]
    assert _advice_at(rows) == [5]


def test_no_advice_when_the_run_learns_or_when_no_group_was_sampled() -> None:
    """Controls: updates that stepped, and updates whose every task failed (no groups), never count."""
    assert _advice_at([replace(STEPPED, update=i) for i in range(10)]) == []
    assert _advice_at([replace(IDLE, update=i, groups=0, groups_dropped=0) for i in range(10)]) == []


def test_failed_tasks_stop_a_run_only_past_the_fraction_or_when_all_fail() -> None:
    lost = [TaskFailure(s, EnvError("maze", "step", "ValueError: wall"), "f.log") for s in range(4)]
    assert too_many([], 4, 0.0) is None
    assert too_many(lost[:2], 4, 0.5) is None  # exactly the fraction: goes on
    line = too_many(lost[:3], 4, 0.5)
    assert line is not None and line.startswith("environment code failed in too many tasks (3 of 4")
    assert too_many(lost[:1], 4, 0.0) is not None  # 0.0: any failure stops
    every = too_many(lost, 4, 1.0)  # 1.0 still stops when every task failed
    assert every is not None and every.startswith("every task failed (4 of 4")
    assert "maze: step raised ValueError: wall; traceback in f.log" in every
