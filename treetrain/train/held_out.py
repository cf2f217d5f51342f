"""Which tasks an evaluation scores, and pass@k: what `treetrain eval` checks before torch loads.

Held-out tasks are the dataset environment's held-out split (`env.kwargs.eval_fraction` or `eval_path`,
row `i` for seed `i`), or for any other environment the seeds from `EVAL_SEED_BASE` on, which no training
seed reaches (`treetrain.rollout.sources.run_settings.task_seeds` gives
`seed * 1_000_003 + update * groups_per_update + g`, with `seed < 2^32`; `check_disjoint` refuses a run long
enough to get there).

pass@k is the unbiased estimator of Chen et al. (2021), `1 - C(n - c, k) / C(n, k)` for `c` passing samples
out of `n`, averaged over tasks:

    >>> pass_at_k(n=4, c=1, k=1), pass_at_k(n=4, c=1, k=4), pass_at_k(n=4, c=0, k=2)
    (0.25, 1.0, 0.0)
    >>> round(pass_at_k(n=5, c=2, k=2), 4)  # 1 - C(3, 2) / C(5, 2) = 1 - 3/10
    0.7
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from envs.registry import resolve
from treetrain.errors import ConfigError
from treetrain.train.config import SEED_LIMIT, TrainConfig

EVAL_SEED_BASE = 1 << 53
"""First held-out seed of environments without a held-out split (above every training seed)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of `k` samples drawn without replacement from `n`, `c` of which
    pass, passes; computed as a product, so no binomial coefficient overflows."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


@dataclass(frozen=True)
class HeldOut:
    """Where an evaluation's tasks come from: the environment's settings for them, and their seeds."""

    kwargs: Mapping[str, Any]
    seeds: tuple[int, ...]
    source: str
    """Said in logs: 'the held-out split (N rows)' or 'seeds training never draws'."""


def held_out_tasks(name: str, kwargs: Mapping[str, Any], tasks: int) -> HeldOut:
    """The held-out tasks of environment `name`: a dataset's held-out rows (all of them when it has fewer
    than `tasks`), or `tasks` seeds from `EVAL_SEED_BASE`. A dataset without a held-out split is refused,
    since any seed would draw rows it trains on."""
    cls = resolve(name)
    count_rows = getattr(cls, "held_out_count", None)
    if count_rows is None:
        return HeldOut(
            dict(kwargs), tuple(EVAL_SEED_BASE + i for i in range(tasks)), "seeds training never draws"
        )
    try:
        env = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"env.kwargs: environment {name!r} rejected {dict(kwargs)}: {exc}") from None
    count = int(env.held_out_count())  # type: ignore[attr-defined]
    if count == 0:
        raise ConfigError(
            f"eval: environment {name!r} has no held-out rows to evaluate on (every row trains); set "
            "env.kwargs.eval_fraction (e.g. 0.1) or env.kwargs.eval_path"
        )
    return HeldOut(
        {**kwargs, "split": "eval"}, tuple(range(min(tasks, count))), f"the held-out split ({count} rows)"
    )


def check_disjoint(cfg: TrainConfig) -> None:
    """Refuse a run whose training seeds would reach `EVAL_SEED_BASE` (it would need about 4.7e15 tasks)."""
    last = (SEED_LIMIT - 1) * 1_000_003 + cfg.updates * cfg.rollout.groups_per_update
    if cfg.eval.every and last >= EVAL_SEED_BASE:
        raise ConfigError(
            f"eval.every: {cfg.updates} updates of {cfg.rollout.groups_per_update} tasks would draw held-out seeds"
        )
