"""Which context group a tree needs: the smallest C at which one rank's share of the update fits the budget.

Why: a tree whose prompt is longer than one device holds is refused by the planner; the useful answer is not
only "nothing fits" but how many ranks would hold it between them (`ReplayConfig.context_parallel`,
docs/long-context.md). Probing every configuration at every C is too slow for an error path, so each C in
2, 4, 8, ... `MAX_CONTEXT` is probed with the configurations that hold the least at once: one branch per
step (K = 1), the context chunk sizes (`plan_search.chunk_candidates`), unbounded retention and no kept
graphs, each priced by the per-rank ledger. The first C at which one fits is the answer: a bound the full
search at that C is sure to meet, since it prices those candidates too.

Example:
    >>> needed_line(4)
    'needs distributed.context_parallel >= 4 (treetrain plan --context-parallel 4) at this budget'
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PreTrainedModel

from treetrain.loss.loss_config import LossConfig
from treetrain.memory.persistent import PersistentBytes
from treetrain.memory.plan_search import TreeSearch, chunk_candidates
from treetrain.models.lora import Reference
from treetrain.replay.batch import ReplayConfig, UpdateBatch

MAX_CONTEXT = 64
"""The largest group probed (eight nodes of eight devices)."""


def context_needed(
    batch: UpdateBatch,
    model: PreTrainedModel,
    loss: LossConfig,
    base: ReplayConfig,
    budget: int,
    persistent: PersistentBytes | None,
    ref_model: Reference | None,
) -> int | None:
    """The smallest power of two C above `base.context_parallel` (up to `MAX_CONTEXT`) at which one rank's
    ledger fits `budget` (see the module docstring); None when none does, or nothing is long enough to cut."""
    longest = max((len(n) for w in batch.work for n in w.tree.nodes), default=0)
    size = 2
    while size <= base.context_parallel:
        size *= 2
    while size <= MAX_CONTEXT and 2 * size <= longest:
        config = replace(base, context_parallel=size, reference_walk="separate")
        search = TreeSearch(batch, model, loss, config, budget, persistent, ref_model)
        for chunk in chunk_candidates(batch, size):
            if search.fits(search.price(1, chunk, None)):
                return size
        size *= 2
    return None


def needed_line(size: int) -> str:
    """The words the planner adds to a refusal when a context group of `size` ranks would fit the tree."""
    return f"needs distributed.context_parallel >= {size} (treetrain plan --context-parallel {size}) at this budget"
