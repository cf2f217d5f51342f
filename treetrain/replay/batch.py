"""What one update replays (`UpdateBatch`), how (`ReplayConfig`), and what came out (`ReplayReport`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

from treetrain.errors import ConfigError
from treetrain.lifetime import ClassBytes, larger
from treetrain.loss.advantages import TreeAdvantages
from treetrain.loss.loss_config import LossConfig
from treetrain.loss.manifest import ContributionKey, Manifest
from treetrain.loss.sampler_correction import SamplerGap
from treetrain.loss.targets import EMPTY, TargetTable, tree_targets
from treetrain.replay.replay_settings import ReplaySettings
from treetrain.replay.schedule import ORDERS, Order
from treetrain.tree.trajectory_tree import TrajectoryTree


@dataclass(frozen=True)
class ReplayConfig(ReplaySettings):
    """How the tree engine schedules work: the run's `ReplaySettings` and what the planner chose. None of
    these change the result, only cost and memory (the contract aside)."""

    microbatch: int = 0
    """K, the sibling units replayed together under autograd (0 = all siblings at once)."""
    chunk_size: int | None = None
    """Split nodes longer than this many tokens into chains (None = never split)."""
    order: Order = "tree"
    """Sibling order: tree order, reversed, or shuffled with `seed` (for invariance tests)."""
    seed: int = 0
    """Seed for order='shuffle'."""
    reference_walk: Literal["fused", "separate"] = "fused"
    """With KL and a reference that is the policy with its adapters off: 'fused' scores it in the scoring
    walk (both KV sets resident during it), 'separate' in a second walk after it (less resident at once)."""
    context_parallel: int = 1
    """C, the ranks of a context group that hold each tree's resident state between them, one piece per rank
    by position block of `chunk_size` (`treetrain.replay.context_shards`); the ledger prices one rank."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.order not in ORDERS:
            raise ConfigError(f"must be one of {ORDERS}, got {self.order!r}", field="order")
        if self.microbatch < 0:
            raise ConfigError(f"must be >= 0 (0 = all siblings), got {self.microbatch}", field="microbatch")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError(
                f"must be >= 1 or None (never split), got {self.chunk_size!r}", field="chunk_size"
            )
        if isinstance(self.context_parallel, bool) or not isinstance(self.context_parallel, int):
            raise ConfigError(
                f"must be a whole number, got {self.context_parallel!r}", field="context_parallel"
            )
        if self.context_parallel < 1:
            raise ConfigError(f"must be >= 1, got {self.context_parallel}", field="context_parallel")
        if self.reference_walk not in ("fused", "separate"):
            raise ConfigError(
                f"must be 'fused' or 'separate', got {self.reference_walk!r}", field="reference_walk"
            )

    @staticmethod
    def of(settings: ReplaySettings, *, seed: int = 0) -> ReplayConfig:
        """The engine's config for the run's `settings` (a `ReplaySection`, say), every shared field carried
        over as it is; K, chunk size and the reference walk are left for the planner to fill in."""
        shared = {f.name: getattr(settings, f.name) for f in fields(ReplaySettings)}
        return ReplayConfig(**shared, seed=seed)


@dataclass(frozen=True)
class TreeWork:
    """One tree with its advantages and per-node loss targets, restricted to the trajectories this process owns."""

    tree: TrajectoryTree
    advantages: TreeAdvantages
    targets: tuple[TargetTable, ...]
    trajectories: frozenset[int]
    """Trajectory indices whose contributions this process replays."""

    def contribution_keys(self, version: int) -> tuple[ContributionKey, ...]:
        return tuple(
            ContributionKey(version, self.tree.id, self.tree.records[t].id, c)
            for t in sorted(self.trajectories)
            for c in range(len(self.tree.records[t].calls))
        )


@dataclass(frozen=True)
class UpdateBatch:
    """The trees of one update window, their loss targets, and the manifest that normalizes them."""

    work: tuple[TreeWork, ...]
    manifest: Manifest

    @staticmethod
    def build(
        trees: Sequence[TrajectoryTree],
        advantages: Sequence[TreeAdvantages],
        loss: LossConfig,
        *,
        version: int = 0,
        owned: Sequence[Collection[int]] | None = None,
    ) -> UpdateBatch:
        """The batch for `trees`, normalized by their manifest (`Manifest.build(trees, version)`).

        This is the one builder of an update batch: the manifest comes from the trees themselves, so no
        caller can pair a batch with another update's normalization. `advantages[i]` is tree i's table,
        i.e. `compute_advantages(group, cfg).trees`, not the `GroupAdvantages` object itself; `loss` sets
        each target's coefficient (aggregation, clipping); `version` is the model version the manifest's
        contributions are keyed by. `owned[i]`, if given, limits tree i to those trajectory indices
        (placement across ranks). `treetrain.build_batch` computes the advantages too, for a list of groups.
        """
        manifest = Manifest.build(trees, version)
        if len(trees) != len(advantages):
            raise ValueError(f"{len(trees)} trees but {len(advantages)} advantage tables")
        work = []
        for i, (tree, adv) in enumerate(zip(trees, advantages)):
            if adv.tree_id != tree.id:
                raise ValueError(f"advantages for tree {adv.tree_id[:12]} given for tree {tree.id[:12]}")
            mine = frozenset(range(len(tree.records))) if owned is None else frozenset(owned[i])
            in_manifest = frozenset(t for t in mine if manifest.contains(tree.id, tree.records[t].id))
            if not in_manifest:
                continue
            tables = tree_targets(tree, adv, manifest, loss)
            if in_manifest != frozenset(range(len(tree.records))):
                tables = tuple(_restrict(t, in_manifest) for t in tables)
            work.append(TreeWork(tree, adv, tables, in_manifest))
        return UpdateBatch(tuple(work), manifest)

    def restricted(self, owned: Mapping[str, Collection[int]]) -> UpdateBatch:
        """The part of this batch one rank replays: tree id -> the trajectory indices it owns. The targets
        keep the coefficients the whole batch's manifest gave them (normalization never depends on how the
        work was split), so this equals `build(..., owned=...)` without recomputing any target."""
        work = []
        for w in self.work:
            mine = w.trajectories & frozenset(owned.get(w.tree.id, ()))
            if not mine:
                continue
            if mine == w.trajectories:
                work.append(w)
            else:
                work.append(
                    TreeWork(w.tree, w.advantages, tuple(_restrict(t, mine) for t in w.targets), mine)
                )
        return UpdateBatch(tuple(work), self.manifest)


def _restrict(table: TargetTable, trajectories: frozenset[int]) -> TargetTable:
    import numpy as np

    if table.num_targets == 0:
        return EMPTY
    keep = np.isin(table.trajectory, sorted(trajectories))
    used = np.unique(table.contrib_target[keep])
    remap = np.full(table.num_targets, -1, dtype=np.int64)
    remap[used] = np.arange(len(used))
    return TargetTable(
        table.positions[used],
        table.tokens[used],
        remap[table.contrib_target[keep]],
        table.coef[keep],
        table.advantage[keep],
        table.sampler_logprob[keep],
        table.trajectory[keep],
        None if table.sampler_version is None else table.sampler_version[keep],
    )


@dataclass(frozen=True)
class ReplayReport:
    """Sums over an update (or part of one). Token counts are what was actually run."""

    loss: float = 0.0
    pg: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clipped: float = 0.0
    graph_tokens: int = 0
    """Tokens forwarded under autograd (each also backpropagated)."""
    nograd_tokens: int = 0
    """Tokens forwarded without a graph: scoring, reference scoring and recompute of evicted KV."""
    steps: int = 0
    skipped_units: int = 0
    recomputed_units: int = 0
    oom_splits: int = 0
    """Steps split in two after running out of memory before backward."""
    evicted_units: int = 0
    """Resident KV dropped (or offloaded) to stay within a retention budget."""
    restored_units: int = 0
    """Offloaded KV copied back from host memory instead of recomputed."""
    kept_graphs: int = 0
    """Internal units whose first forward kept its graph for their own step (no recompute)."""
    reference_walks: int = 0
    """Trees whose reference logprobs took a walk of their own (0 with KL: scored in the scoring walk)."""
    crossed_bytes: int = 0
    """Bytes this rank put into its context group's collectives (`ExchangeCounts`; 0 without a group)."""
    measured_peak: ClassBytes | None = None
    """Peak live bytes by lifetime class, when a memory tracker was attached (the larger of two on merge)."""
    sampler_gap: SamplerGap = field(default_factory=SamplerGap)
    """|scoring - sampler| logprob over the policy tokens scored (empty without a scoring pass)."""

    def merged(self, other: ReplayReport) -> ReplayReport:
        summed = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name not in ("measured_peak", "sampler_gap")
        }
        return ReplayReport(
            **summed,
            measured_peak=larger(self.measured_peak, other.measured_peak),
            sampler_gap=self.sampler_gap.merged(other.sampler_gap),
        )

    @property
    def token_cost(self) -> int:
        """Token-ceiling units actually spent: forward 1, backward 2."""
        return 3 * self.graph_tokens + self.nograd_tokens
