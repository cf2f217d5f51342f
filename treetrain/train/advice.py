"""Advice for a run that is not learning: said once, when a streak of updates had nothing to learn from.

An update whose every group had zero reward variance (every episode of a task got the same reward) makes
no optimizer step: GRPO's advantages are all zero, so there is no gradient, and no token is saved either
(`tokens saved 0.0%`). One such update is ordinary; several in a row mean the task gives the policy no
signal: typically a model that never solves it. `no_signal_advice` looks at the updates so far and returns
the advice exactly once, at the update where the first such streak reaches `after` updates, so a resumed
run that reads its metrics back does not repeat it.

Example:
    >>> from dataclasses import replace
    >>> from treetrain.train.metrics import UpdateMetrics
    >>> idle = UpdateMetrics(update=0, version=0, reward_mean=0.0, reward_std=0.0, trajectories=8, groups=2,
    ...     groups_dropped=2, loss=0.0, pg=0.0, kl=0.0, entropy=0.0, clipped=0.0, mode="none", contract="exact",
    ...     graph_tokens=0, nograd_tokens=0, flat_token_cost=0, token_cost=0, rollout_seconds=1.0,
    ...     train_seconds=0.0, peak_bytes=0, predicted_peak_bytes=0)
    >>> rows = [replace(idle, update=i) for i in range(4)]
    >>> [no_signal_advice(rows[: i + 1]) is not None for i in range(4)]
    [False, False, True, False]
"""

from __future__ import annotations

from collections.abc import Sequence

from treetrain.train.metrics import UpdateMetrics

NO_SIGNAL_STREAK = 3
"""Updates in a row without an optimizer step, for lack of reward variance, before the advice is given."""


def no_signal(row: UpdateMetrics) -> bool:
    """The update had groups, and every one had zero reward variance: no optimizer step."""
    return row.mode == "none" and row.groups > 0


def no_signal_advice(rows: Sequence[UpdateMetrics], after: int = NO_SIGNAL_STREAK) -> str | None:
    """The advice, when the last row completes the run's first streak of `after` no-signal updates; else None."""
    streak, first_done = 0, -1
    for i, row in enumerate(rows):
        streak = streak + 1 if no_signal(row) else 0
        if streak == after:
            first_done = i
            break
    if first_done != len(rows) - 1:
        return None
    rewards = sorted({round(r.reward_mean, 4) for r in rows[-after:]})
    seen = ", ".join(f"{r:g}" for r in rewards)
    return (
        f"{after} updates in a row made no optimizer step: within every task all episodes got the same reward "
        f"(mean reward {seen}), so the advantages are zero, there is no gradient, and no tokens are saved. "
        "The policy gets no signal from this task. Try more samples per task (rollout.fanout.root), a rubric "
        "that gives partial rewards (env.rubric, or your Rubric.score), easier tasks, or a stronger model.path."
    )
