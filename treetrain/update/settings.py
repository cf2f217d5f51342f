"""What an update is configured by: the replay section, and the run settings the update reads.

`ReplaySection` is the `replay` section of the run's config file, and the update consumes it as it is:
it fixes the engine settings (`engine_config`) and forces whichever planner choices it names
(`overrides`). `UpdateSettings` is the part of the trainer's config that one update reads; the trainer's
`TrainConfig` satisfies it, so this layer never imports the trainer's. Nothing here imports torch: the
command line validates a config before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from treetrain.bytesize import parse_bytes
from treetrain.errors import ConfigError
from treetrain.loss.advantages import AdvantageConfig
from treetrain.loss.loss_config import LossConfig
from treetrain.models import DEFAULT_MAX_LOGIT_ELEMENTS
from treetrain.replay.schedule import Contract

if TYPE_CHECKING:
    from treetrain.memory.planner import Overrides
    from treetrain.replay.batch import ReplayConfig


@dataclass(frozen=True)
class ReplaySection:
    """How each update is replayed. Fields left null are chosen per update by the planner (`treetrain plan`)."""

    contract: Contract = "exact"
    """exact: the same gradient as flat; response_only: resident KV detached (cheaper, biased; see docs/design.md)."""
    microbatch: int | None = None
    """K, sibling branches replayed together (0 = all); null: the planner chooses."""
    chunk_size: int | None = None
    """Split nodes longer than this into chains (0 = never split); null: the planner chooses."""
    retention: str | None = None
    """Byte budget for resident state ('256MiB') or 'unbounded'; null: the planner chooses within memory_budget."""
    keep_graphs: Literal["none", "all", "auto"] | None = None
    """exact mode: keep internal nodes' first-forward graphs instead of recomputing; null: the planner chooses."""
    min_speedup: float = 1.25
    """mode=auto picks tree only when its token-ceiling speedup over flat is at least this (or only tree fits)."""
    score_microbatch: int = 0
    """Sibling units per no-grad scoring forward (0 = all)."""
    skip_inert: bool = True
    """Skip branches whose advantages are all zero when no KL or entropy term is on (no gradient at all)."""
    max_logit_elements: int = DEFAULT_MAX_LOGIT_ELEMENTS
    """Largest logits chunk (rows x vocabulary) materialized at once."""

    def __post_init__(self) -> None:
        if self.contract not in ("exact", "response_only"):
            raise ConfigError(f"replay.contract: must be 'exact' or 'response_only', got {self.contract!r}")
        for name in ("microbatch", "chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"replay.{name}: must be >= 0 or null, got {value}")
        if self.retention is not None and self.retention != "unbounded":
            try:
                parse_bytes(self.retention)
            except ValueError as exc:
                raise ConfigError(f"replay.retention: {exc}") from exc
        if not self.min_speedup > 0:
            raise ConfigError(f"replay.min_speedup: must be > 0, got {self.min_speedup}")
        if self.score_microbatch < 0 or self.max_logit_elements < 1:
            raise ConfigError("replay.score_microbatch must be >= 0 and replay.max_logit_elements >= 1")

    def engine_config(self, seed: int) -> ReplayConfig:
        """The engine settings this section fixes; the planner fills in K, chunk size and the reference walk."""
        from treetrain.replay.batch import ReplayConfig  # the engine loads torch; the config must not

        return ReplayConfig(
            contract=self.contract,
            score_microbatch=self.score_microbatch,
            skip_inert=self.skip_inert,
            max_logit_elements=self.max_logit_elements,
            seed=seed,
        )

    def overrides(self, mode: Literal["auto", "tree", "flat"]) -> Overrides:
        """The planner's choices this section (and the run's `mode`) force; null fields are left to it."""
        from treetrain.memory.planner import Overrides

        retention: int | Literal["unbounded"] | None = None
        if self.retention is not None:
            retention = "unbounded" if self.retention == "unbounded" else parse_bytes(self.retention)
        return Overrides(
            mode=None if mode == "auto" else mode,
            microbatch=self.microbatch,
            chunk_size=self.chunk_size,
            retention=retention,
            keep_graphs=self.keep_graphs,
        )


class UpdateSettings(Protocol):
    """The settings one update reads (`treetrain.train.config.TrainConfig` has them all)."""

    @property
    def seed(self) -> int: ...
    @property
    def mode(self) -> Literal["auto", "tree", "flat"]: ...
    @property
    def memory_budget(self) -> str | None: ...
    @property
    def loss(self) -> LossConfig: ...
    @property
    def advantages(self) -> AdvantageConfig: ...
    @property
    def replay(self) -> ReplaySection: ...
