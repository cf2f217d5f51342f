"""The planner's choices a user may force (`Overrides`), checked here once for every way they arrive.

The config file's `replay` section (`treetrain.update.settings.ReplaySection`), `treetrain plan`'s flags and
the Python API all force choices by building an `Overrides`; None leaves a choice to the planner
(`treetrain.memory.planner.plan_update`). Nothing here imports torch: the config's section builds one to
check itself before torch loads.

Example:
    >>> Overrides(mode="tree", chunk_size=0).forced()
    ('mode', 'chunk_size')
    >>> Overrides(microbatch=-1)
    Traceback (most recent call last):
    treetrain.errors.ConfigError: microbatch: must be >= 0 or null, got -1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from treetrain.errors import ConfigError

Mode = Literal["tree", "flat"]
KeepChoice = Literal["none", "all", "auto"]


@dataclass(frozen=True)
class Overrides:
    """Choices the user forces; None leaves a choice to the planner."""

    mode: Mode | None = None
    """'tree' or 'flat'."""
    microbatch: int | None = None
    """K in tree mode (0 = all siblings), calls per microbatch in flat mode."""
    chunk_size: int | None = None
    """Unit length in tree mode; 0 means never split (the engine's `ReplayConfig.chunk_size=None`)."""
    retention: int | Literal["unbounded"] | None = None
    """Retention budget in bytes, or 'unbounded'."""
    keep_graphs: KeepChoice | None = None
    """'none', 'all' (every internal unit) or 'auto' (the planner's greedy choice)."""

    def __post_init__(self) -> None:
        if self.mode not in (None, "tree", "flat"):
            raise ConfigError(f"must be 'tree' or 'flat', got {self.mode!r}", field="mode")
        for name, value in (("microbatch", self.microbatch), ("chunk_size", self.chunk_size)):
            if value is not None and value < 0:
                raise ConfigError(f"must be >= 0 or null, got {value}", field=name)
        if isinstance(self.retention, int) and self.retention < 0:
            raise ConfigError(f"must be >= 0 bytes, got {self.retention}", field="retention")
        if self.keep_graphs not in (None, "none", "all", "auto"):
            raise ConfigError(
                f"must be 'none', 'all' or 'auto', got {self.keep_graphs!r}", field="keep_graphs"
            )

    def forced(self) -> tuple[str, ...]:
        return tuple(
            f
            for f in ("mode", "microbatch", "chunk_size", "retention", "keep_graphs")
            if getattr(self, f) is not None
        )

    @property
    def chunk(self) -> int | None:
        """The forced chunk size as the engine spells it (`ReplayConfig.chunk_size`: None = never split)."""
        return self.chunk_size or None
