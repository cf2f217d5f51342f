"""Context groups on paper: the longest prefix one rank's budget holds at C = 1, 2, 4, and the bytes a rank
sends per update against the prefix's resident bytes.

Both come from the per-rank ledger (`treetrain.memory.ledger.predict_ledger` with
`ReplayConfig.context_parallel`, priced by `treetrain.memory.context_cost`), so a grid of prefix lengths
costs seconds rather than a torchrun per point. bench/context_runs.py is the measured check:
it trains in real groups and sets each rank's measured peak beside this ledger's.

- `longest_prefix_per_rank`: galloping then bisection over prefixes (multiples of `search_step`, as
  `treetrain.benchmark.longest_prefix` does), with the chunk size fixed for every C so that only the
  sharding differs; the ownership block is that chunk.
- `transfer_breakdown`: the bytes one rank sends over one update, split into the leaf branches' replay
  steps and everything that forwards the shared units themselves (their scoring or first forward, their
  recomputes and, in `exact`, their closing steps), against the prefix's resident KV.

Example:
    >>> fits = longest_prefix_per_rank(model, Geometry(8, 64), "exact", Search(64 << 20, 512), 2)  # doctest: +SKIP
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from transformers import PreTrainedModel

from treetrain.benchmark.bench_config import BenchConfig, GridPoint
from treetrain.benchmark.longest_prefix import gallop_bisect
from treetrain.benchmark.workload import LOSS, bench_batch
from treetrain.lifetime import ClassBytes
from treetrain.memory.context_cost import ContextShare, query_bytes
from treetrain.memory.events import plan_tree
from treetrain.memory.ledger import predict_ledger
from treetrain.memory.persistent import kv_bytes_per_token
from treetrain.replay.batch import ReplayConfig
from treetrain.replay.schedule import Contract


@dataclass(frozen=True)
class Geometry:
    """G branches of `suffix` tokens after a shared prefix, one turn."""

    branches: int
    suffix: int


@dataclass(frozen=True)
class Search:
    """The per-rank budget and how the prefix is searched."""

    budget: int
    """Bytes one rank may hold (everything: parameters, gradients, resident shards, graphs, buffers)."""
    chunk: int
    """Chunk size, the same for every C: the ownership block."""
    microbatch: int = 4
    """K, branches per replay step."""
    step: int = 512
    """Prefixes searched are multiples of this."""
    top: int = 1 << 18
    """Longest prefix probed (reported as 'at least')."""


@dataclass(frozen=True)
class RankFit:
    """The longest prefix one rank's budget holds in a group of `size`."""

    size: int
    contract: Contract
    prefix: int
    capped: bool
    """The search's top fits: the answer is at least `prefix`."""
    peak: ClassBytes
    """The per-rank peak at `prefix` (the highest rank's)."""


def replay_for(contract: Contract, search: Search, size: int) -> ReplayConfig:
    return ReplayConfig(
        contract=contract, microbatch=search.microbatch, chunk_size=search.chunk, context_parallel=size
    )


def _config(cfg: BenchConfig) -> BenchConfig:
    return replace(cfg, reps=1)


def longest_prefix_per_rank(
    model: PreTrainedModel, shape: Geometry, contract: Contract, search: Search, size: int, cfg: BenchConfig
) -> RankFit:
    """The longest prefix whose per-rank ledger peak fits `search.budget` in a group of `size`."""
    replay = replay_for(contract, search, size)
    peaks: dict[int, ClassBytes] = {}

    def fits(n: int) -> bool:
        batch = bench_batch(GridPoint(n * search.step, shape.branches, shape.suffix, 1), _config(cfg))
        peaks[n] = predict_ledger(batch, model, replay, LOSS).peak
        return peaks[n].total <= search.budget

    n, capped = gallop_bisect(fits, search.top // search.step)
    return RankFit(size, contract, n * search.step, capped, peaks.get(n, ClassBytes()))


BRANCHES = "branches"
SHARED = "shared"


@dataclass(frozen=True)
class Transfer:
    """Bytes one rank sends over one update, by event kind, against the prefix's resident KV."""

    size: int
    contract: Contract
    prefix_resident: int
    """P x KV bytes per token: the prefix's resident KV over the whole group."""
    sent: dict[str, int]
    """`BRANCHES` (replay steps of leaf branches: the queries are the answers' tokens) and `SHARED` (every
    forward and close of a shared unit: the queries are the prefix's own tokens) -> bytes sent."""

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def ratio(self, kinds: tuple[str, ...] | None = None) -> float:
        part = self.total if kinds is None else sum(self.sent.get(k, 0) for k in kinds)
        return part / self.prefix_resident


def transfer_breakdown(
    model: PreTrainedModel, point: GridPoint, contract: Contract, search: Search, size: int, cfg: BenchConfig
) -> Transfer:
    """What `RankShare.sent_bytes` sums, split as `Transfer.sent` says (every rank sends the same)."""
    batch = bench_batch(point, _config(cfg))
    replay = replay_for(contract, search, size)
    share = ContextShare(size, 0, search.chunk, query_bytes(model))
    per_token = kv_bytes_per_token(model)
    sent: Counter[str] = Counter()
    for work in batch.work:
        tp = plan_tree(work, replay, LOSS, kv_bytes_per_token=per_token)
        for ev in (*tp.events, *tp.reference_events):
            leaves = ev.kind == "step" and all(tp.units[u].is_leaf for u in ev.units)
            sent[BRANCHES if leaves else SHARED] += share.sent(ev)
    return Transfer(size, contract, point.prefix * per_token, dict(sent))
