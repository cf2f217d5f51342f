"""What the geometry benchmark measures, and on what: the grid, the model, the engine settings.

The model is a random-init Llama config sized so that per-token linear FLOPs are at least comparable to
attention's at these lengths: hidden 256, 2 layers, MLP 1024, 4 query heads of 64, 1 KV head (grouped
query attention, like most current models, which keeps resident KV small). That is about 2M
parameters; a forward and backward of one token then costs about 12 MFLOP in the linear layers against
about 4·L·hidden·layers FLOP in attention at context L, so linear and attention are equal near L = 2k,
linear dominates below and attention above. fp32, sdpa attention, on the CPU.

Flat runs one trajectory per microbatch (a conventional trainer with microbatch 1). The tree modes run
K = 4 sibling branches per replay step and split nodes into chunks of 512 tokens (a 8192-token prompt is
16 units). Old logprobs come from the sampler (`ratio_source="sampler"`), so no mode runs a scoring pass
and the ceilings are docs/design.md's plain ones: flat 3·T, response_only U_ctx + 3·(U − U_ctx), exact
4·U_int + 3·U_leaf.

Example:
    >>> len(FULL.points()), FULL.points()[0]
    (24, GridPoint(prefix=512, branches=2, suffix=64, depth=1))
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product
from typing import Literal

Mode = Literal["flat", "exact", "response_only"]
MODES: tuple[Mode, ...] = ("flat", "exact", "response_only")


@dataclass(frozen=True, order=True)
class GridPoint:
    """One geometry: a `prefix`-token prompt, `branches` = G trajectories, `suffix` tokens after the prompt
    per trajectory, spread over `depth` turns (`treetrain.tree.synthetic.synthetic_group`)."""

    prefix: int
    branches: int
    suffix: int
    depth: int

    @property
    def label(self) -> str:
        return f"P={self.prefix} G={self.branches} S={self.suffix} d={self.depth}"


@dataclass(frozen=True)
class ModelSpec:
    """The benchmarked model: a random-init config of a supported family."""

    family: str = "llama"
    """Model family (`treetrain.models.presets.FAMILIES`)."""
    hidden_size: int = 256
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 1
    """Key/value heads."""
    intermediate_size: int = 1024
    """MLP width."""
    vocab_size: int = 256
    """Vocabulary (synthetic token ids are drawn from it)."""
    max_positions: int = 65536
    """Position limit; above the budget search's cap."""
    dtype: str = "float32"
    """Parameter and activation dtype."""
    attn: str = "sdpa"
    """Attention implementation."""
    seed: int = 0
    """Initialisation seed."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run depends on; `FULL` is the published grid, `QUICK` the smoke test."""

    prefixes: tuple[int, ...] = (512, 2048, 8192)
    branches: tuple[int, ...] = (2, 8)
    suffixes: tuple[int, ...] = (64, 512)
    depths: tuple[int, ...] = (1, 3)
    reps: int = 3
    """Timed repetitions per point and mode (interleaved); the median is reported."""
    model: ModelSpec = field(default_factory=ModelSpec)
    microbatch: int = 4
    """K: sibling branches per tree replay step."""
    chunk_size: int = 512
    """Tree modes split nodes into units of at most this many tokens."""
    flat_microbatch: int = 1
    """Trajectories per flat microbatch."""
    threads: int = 1
    """torch intra-op threads. One: on a small machine shared with other work, more threads only contend
    (spinning workers stall when a core is taken), which would punish the modes with more, smaller ops."""
    memory_limit: int = 128 << 20
    """Device bytes (everything: parameters, gradients, resident KV, graphs) for the longest-prefix search."""
    max_search_prefix: int = 32768
    """The longest-prefix search stops here (reported as 'at least')."""
    search_step: int = 64
    """Granularity of the longest-prefix search, in tokens."""
    confirm: tuple[tuple[int, int, int], ...] = ((8, 64, 1), (2, 64, 1))
    """(G, suffix, depth) combinations whose tree-mode longest prefixes are checked by measured runs."""
    search: tuple[tuple[int, int, int], ...] | None = None
    """(G, suffix, depth) combinations whose longest prefix is searched (None: every one of the grid)."""
    seed: int = 0
    """Seed of the synthetic trees."""

    def __post_init__(self) -> None:
        for name in ("prefixes", "branches", "suffixes", "depths"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise ValueError(f"BenchConfig.{name} must be non-empty positive ints, got {values!r}")
        for s, d in product(self.suffixes, self.depths):
            if s < d:
                raise ValueError(f"suffix {s} is shorter than depth {d}: every turn needs a token")
        if self.reps < 1 or self.microbatch < 1 or self.chunk_size < 1 or self.flat_microbatch < 1:
            raise ValueError("reps, microbatch, chunk_size and flat_microbatch must be >= 1")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.search_step < 1 or self.max_search_prefix < self.search_step:
            raise ValueError("search_step must be >= 1 and max_search_prefix >= search_step")

    def points(self) -> tuple[GridPoint, ...]:
        """Every grid point, prefix-major."""
        return tuple(
            GridPoint(p, g, s, d)
            for p, g, s, d in product(self.prefixes, self.branches, self.suffixes, self.depths)
        )

    def shapes(self) -> tuple[tuple[int, int, int], ...]:
        """The (G, suffix, depth) combinations: the longest-prefix search runs once per combination."""
        every = tuple(product(self.branches, self.suffixes, self.depths))
        return every if self.search is None else tuple(s for s in every if s in self.search)


FULL = BenchConfig()

QUICK = BenchConfig(
    prefixes=(64,),
    branches=(2, 8),
    suffixes=(8,),
    depths=(1,),
    reps=1,
    model=ModelSpec(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=64
    ),
    microbatch=2,
    chunk_size=32,
    threads=1,
    memory_limit=(3 << 20) // 2,
    max_search_prefix=1024,
    search_step=32,
    confirm=((8, 8, 1),),
)
"""A seconds-long run of the same code on a tiny model and grid (the smoke test's)."""

TARGETS = replace(
    FULL, prefixes=(2048, 8192), branches=(8,), suffixes=(64,), depths=(1, 3), reps=1,
    confirm=((8, 64, 1),), search=((8, 64, 1),),
)  # fmt: skip
"""Only the speed-target points (P >= 2048, G = 8, S = 64) and the G = 8 longest-prefix search, one
repetition: a fraction of the full grid's time, for a machine that cannot spare the full run."""

REAL_LAYER = replace(
    FULL, prefixes=(1024,), branches=(8,), suffixes=(64,), depths=(1,), reps=1, confirm=(), search=(),
    model=ModelSpec(hidden_size=2048, num_layers=1, num_heads=16, num_kv_heads=2, intermediate_size=6144),
)  # fmt: skip
"""One point with a real-size layer (hidden 2048, 16 query and 2 KV heads of 128, MLP 6144) at depth 1,
where attention costs what it costs in a 1-2B model relative to the linear layers."""

GRIDS = {"full": FULL, "quick": QUICK, "targets": TARGETS, "real-layer": REAL_LAYER}


def with_overrides(cfg: BenchConfig, **changes: object) -> BenchConfig:
    """`cfg` with some fields replaced (validated again)."""
    return replace(cfg, **changes)  # type: ignore[arg-type]
