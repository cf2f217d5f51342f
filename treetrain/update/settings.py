"""What an update is configured by: the replay section, and the run settings the update reads.

`ReplaySection` is the `replay` section of the run's config file, and the planner consumes it as it is
(`treetrain.update.planning.plan_for`): it fixes the replay settings (`replay_config`) and forces whichever
planner choices it names (`overrides`); the planner's `Plan` is the next and last form of those settings. The settings it shares with the engine are `ReplaySettings`' (declared and checked once,
`treetrain.replay.replay_settings`), and its forced choices are checked by the `Overrides` it builds, as
every other caller's are. `UpdateSettings` is the part of the trainer's config that one update reads; the trainer's
`TrainConfig` satisfies it, so this layer never imports the trainer's; `UpdateConfig` is the same settings
as a record, for the Python API and tests. Nothing here imports torch: the command line validates a config
before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from treetrain.bytesize import parse_bytes
from treetrain.errors import ConfigError
from treetrain.loss.advantages import AdvantageConfig
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.overrides import Overrides
from treetrain.replay.replay_settings import ReplaySettings

if TYPE_CHECKING:
    from treetrain.replay.batch import ReplayConfig


@dataclass(frozen=True)
class ReplaySection(ReplaySettings):
    """How each update is replayed: the shared `ReplaySettings`, and the planner's choices a user may force.
    Fields left null are chosen per update by the planner (`treetrain plan`)."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        self.overrides("auto")  # the forced choices are checked where every caller's are: `Overrides`
        if not self.min_speedup > 0:
            raise ConfigError(f"replay.min_speedup: must be > 0, got {self.min_speedup}")

    def replay_config(self, seed: int) -> ReplayConfig:
        """The replay settings this section fixes (`ReplayConfig.of`); the planner fills in K, chunk size
        and the reference walk."""
        from treetrain.replay.batch import ReplayConfig  # the replayer loads torch; the config must not

        return ReplayConfig.of(self, seed=seed)

    def overrides(self, mode: Literal["auto", "tree", "flat"]) -> Overrides:
        """The planner's choices this section (and the run's `mode`) force; null fields are left to it."""
        retention: int | Literal["unbounded"] | None = None
        if self.retention is not None:
            try:
                retention = "unbounded" if self.retention == "unbounded" else parse_bytes(self.retention)
            except ValueError as exc:
                raise ConfigError(str(exc), field="retention") from exc
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
    def policy_loss(self) -> LossConfig:
        """The loss as the update scores it (its temperature resolved): one for batch, plan and replay."""
        ...

    @property
    def advantages(self) -> AdvantageConfig: ...
    @property
    def replay(self) -> ReplaySection: ...


@dataclass(frozen=True)
class UpdateConfig:
    """`UpdateSettings` as a record: what `run_update` reads, for callers without a trainer's config."""

    policy_loss: LossConfig = field(default_factory=LossConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    replay: ReplaySection = field(default_factory=ReplaySection)
    mode: Literal["auto", "tree", "flat"] = "auto"
    memory_budget: str | None = None
    """Bytes the planner may plan for ('8GiB'); None: the device's memory."""
    seed: int = 0
