"""How tokens are drawn: temperature and nucleus mass, the `rollout.sampling` section of a run's config.

Kept apart from the sampler itself so that reading a config imports no torch: the command line refuses a
bad setting before torch loads, in under a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from treetrain.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn from the model's distribution; the trainer's `rollout.sampling` section.

    Errors name the field alone (`top_p: ...`); the config loader puts the section in front.

    Example:
        >>> Sampling(temperature=0.7).greedy, Sampling(temperature=0).greedy
        (False, True)
    """

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax, logprob 0), which the trainer refuses for RL."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]: sample only from the most likely tokens whose probabilities sum to it (1: all)."""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"must be a finite number, got {value!r}", field=name)
        if self.temperature < 0:
            raise ConfigError(f"must be >= 0 (0: greedy), got {self.temperature!r}", field="temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.top_p!r}", field="top_p")

    @property
    def greedy(self) -> bool:
        """True at temperature 0: each token is the argmax, drawn from a point mass."""
        return self.temperature == 0
