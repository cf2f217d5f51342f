"""What `treetrain plan` refuses before it plans: work it cannot price in bounded time, and trees with
nothing to train.

Pricing a replay walks every unit (a node, or a piece of one `--chunk-size` tokens long) of every tree, and
its cost grows faster than the number of units: `--chunk-size 1` on a shipped tree made 2,374 units and gave
no answer within 300 s. The planner's own search never splits below `SMALLEST_CHUNK` tokens; a forced chunk
size that makes more units than that (or than `MAX_PLAN_UNITS`) is refused up front, naming the smallest
chunk size that is answered.

Trees whose rewards are all equal have zero variance: every advantage is 0, and an update of them trains
nothing. A plan of them would print a speedup of nothing over nothing (`3608.00x`, `infx`); `plan` says why
instead.

Example:
    >>> from treetrain.tree.synthetic import synthetic_group
    >>> named = [("a.msgpack", (synthetic_group(prefix=2000, branches=2, suffix=8, vocab=50, seed=0),))]
    >>> planning_units(named, 16), planning_units(named, 1)
    (127, 2016)
    >>> check_planning_work(named, 1, "--chunk-size")
    Traceback (most recent call last):
    treetrain.errors.ConfigError: --chunk-size: 1 splits the trees into 2,016 units, more than the 512 a plan prices in bounded time; give 4 or more (or 0: never split)
"""

from __future__ import annotations

from collections.abc import Sequence

from treetrain.errors import ConfigError
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.tree.checks import NamedTrees

SMALLEST_CHUNK = 16
"""The shortest unit the planner's own search tries (`treetrain.memory.plan_search.chunk_candidates`)."""
MAX_PLAN_UNITS = 512
"""Units a forced chunk size may make beyond what the planner's own search prices (on 2 CPU cores, 600
units of one tree take about 15 s to plan, and the cost grows faster than the count)."""


def planning_units(named: NamedTrees, chunk_size: int) -> int:
    """How many units the trees make when no node is longer than `chunk_size` tokens (0: whole nodes)."""
    return sum(
        -(-len(node) // chunk_size) if chunk_size else 1
        for _, group in named
        for tree in group
        for node in tree.nodes
    )


def check_planning_work(named: NamedTrees, chunk_size: int | None, field: str) -> None:
    """Refuse a forced `chunk_size` that makes more units than a plan prices in bounded time."""
    if not chunk_size:
        return
    units = planning_units(named, chunk_size)
    bound = max(MAX_PLAN_UNITS, planning_units(named, SMALLEST_CHUNK))
    if units <= bound:
        return
    low, high = chunk_size, max((len(n) for _, g in named for t in g for n in t.nodes), default=1)
    while low < high:  # the smallest chunk size within the bound (units fall as the chunk grows)
        mid = (low + high) // 2
        low, high = (mid + 1, high) if planning_units(named, mid) > bound else (low, mid)
    raise ConfigError(
        f"{field}: {chunk_size} splits the trees into {units:,} units, more than the {bound:,} a plan prices "
        f"in bounded time; give {low} or more (or 0: never split)"
    )


def nothing_to_train(named: NamedTrees, loss: LossConfig, adv: AdvantageConfig, *, kept: int) -> str | None:
    """Why an update of these trees trains nothing (every group has equal rewards), or None.

    `kept` is how many groups the advantages kept (`advantages.zero_variance=keep` keeps them, with every
    advantage 0: only a KL term, `loss.kl_coef > 0`, then has something to train)."""
    groups: Sequence[int] = [
        int(compute_advantages(list(group), adv).zero_variance) for _, group in named if group
    ]
    if not groups or sum(groups) < len(groups):
        return None
    equal = (
        f"every one of the {len(groups)} tree groups has equal rewards (zero variance: every advantage is 0)"
    )
    if kept == 0:
        keep = (
            "; set advantages.zero_variance=keep to plan them (loss.kl_coef > 0 still trains on them)"
            if loss.needs_reference
            else ", and with loss.kl_coef=0 there is nothing else to train: nothing to plan"
        )
        return f"{equal}, so `treetrain train` would drop them all (advantages.zero_variance=drop){keep}"
    if loss.needs_reference:
        return None
    return (
        f"{equal}, so an update of them trains nothing (loss.kl_coef=0: no KL term either): nothing to plan; "
        "give trees whose rewards differ within a file"
    )
