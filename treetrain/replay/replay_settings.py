"""The replay settings the run fixes, declared once: the config file's `replay` section and the engine's
`ReplayConfig` both are these, plus what each adds.

`ReplaySection` (`treetrain.update.settings`) adds the planner's choices a user may force (K, chunk size,
retention, kept graphs; null leaves each to the planner); `ReplayConfig` (`treetrain.replay.batch`) adds
what the planner chose (K, chunk size, reference walk) and the invariance tests' order. Both derive from
`ReplaySettings`, so each shared field has one declaration, one docstring and one check, and
`ReplayConfig.of(section, ...)` carries them over field by field. Nothing here imports torch: the command
line validates a config before torch loads.

Example:
    >>> ReplaySettings(contract="response_only").skip_inert
    True
    >>> ReplaySettings(score_microbatch=-1)
    Traceback (most recent call last):
    treetrain.errors.ConfigError: score_microbatch: must be >= 0 (0 = all), got -1
"""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.errors import ConfigError
from treetrain.models import DEFAULT_MAX_LOGIT_ELEMENTS
from treetrain.replay.schedule import CONTRACTS, Contract


@dataclass(frozen=True)
class ReplaySettings:
    """Replay settings that change only cost and memory, never the gradient (the contract aside)."""

    contract: Contract = "exact"
    """exact: the same gradient as flat; response_only: resident KV detached (cheaper, biased; see docs/design.md)."""
    score_microbatch: int = 0
    """Sibling units per no-grad scoring forward (0 = all)."""
    skip_inert: bool = True
    """Skip branches whose advantages are all zero when no KL or entropy term is on (no gradient at all)."""
    max_logit_elements: int = DEFAULT_MAX_LOGIT_ELEMENTS
    """Largest logits chunk (rows x vocabulary) materialized at once."""

    def __post_init__(self) -> None:
        if self.contract not in CONTRACTS:
            raise ConfigError(f"must be 'exact' or 'response_only', got {self.contract!r}", field="contract")
        if self.score_microbatch < 0:
            raise ConfigError(
                f"must be >= 0 (0 = all), got {self.score_microbatch}", field="score_microbatch"
            )
        if self.max_logit_elements < 1:
            raise ConfigError(f"must be >= 1, got {self.max_logit_elements}", field="max_logit_elements")
