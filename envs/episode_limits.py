"""How long one episode may run: `EpisodeLimits`, the trainer's `rollout.episode` config section.

The token wrapper (`envs.wrapper.TokenEnv`) takes these limits as they are, and the configuration loader
reads them as a config section, so they live apart from the wrapper: the config answers a bad value before
anything of the wrapper or the model loads. Each limit has a ceiling (`TURN_LIMIT` and the rest), because
batches, buffers and deadlines are sized from it: a typo must not ask for an unbounded episode.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from treetrain.errors import ConfigError

TURN_LIMIT = 1 << 12
"""Most assistant turns per episode: a typo must not make an episode run (and record) without end."""
TURN_TOKEN_LIMIT = 1 << 20
"""Most tokens one turn may sample: the sampler's buffers grow with it."""
EPISODE_TOKEN_LIMIT = 1 << 24
"""Most tokens in one model call's context: batches and buffers are sized from it."""
MAX_STEP_TIMEOUT_S = 7 * 86400.0
"""Longest environment step timeout (a week); beyond the platform's clocks a deadline overflows."""
UNKNOWN_CONTEXT_TOKENS = 8192
"""The episode budget when `max_episode_tokens` is null and the model's context is not known."""


@dataclass(frozen=True)
class EpisodeLimits:
    """How long one episode may run; the trainer's `rollout.episode` section.

    Errors name the field alone (`max_turns: ...`); the config loader puts the section in front.

    Example:
        >>> EpisodeLimits().max_turns, EpisodeLimits().for_context(2048).max_episode_tokens
        (4, 2048)
    """

    max_turns: int = 4
    """Assistant turns per episode; after this many the episode ends (finish "max_turns")."""
    max_turn_tokens: int = 96
    """Most tokens sampled in one assistant turn. A turn cut here gets its end-of-turn marker supplied as an
    observation token, and the environment sees the truncated text."""
    max_episode_tokens: int | None = None
    """Most tokens in one model call's context, prompt, policy and observations included; when an
    observation would not leave room for one more policy token, the episode ends (finish "max_tokens").
    Null: the model's context length (`max_position_embeddings`); the trainer refuses a value above it
    before any work."""
    step_timeout_s: float | None = 30.0
    """Seconds one environment step may take; on timeout each tool call gets an `Error: ... timed out`
    observation and the environment keeps its pre-step state. Null waits forever (and skips the per-step
    copy of the environment that a timeout needs)."""

    def __post_init__(self) -> None:
        limits = {
            "max_turns": TURN_LIMIT, "max_turn_tokens": TURN_TOKEN_LIMIT, "max_episode_tokens": EPISODE_TOKEN_LIMIT,
        }  # fmt: skip
        for name, most in limits.items():
            value = getattr(self, name)
            if value is None and name == "max_episode_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"must be an integer, got {value!r}", field=name)
            if not 1 <= value <= most:
                raise ConfigError(f"must be in [1, {most}], got {value}", field=name)
        timeout = self.step_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= MAX_STEP_TIMEOUT_S
        ):
            raise ConfigError(
                f"must be in (0, {MAX_STEP_TIMEOUT_S:g}] seconds or null (no timeout), got {timeout!r}",
                field="step_timeout_s",
            )

    def episode_tokens(self, context: int | None = None) -> int:
        """The token budget of one model call: `max_episode_tokens`, or when null the model's `context`, or
        `UNKNOWN_CONTEXT_TOKENS` when that is not known either."""
        return self.max_episode_tokens or context or UNKNOWN_CONTEXT_TOKENS

    def for_context(self, context: int | None) -> EpisodeLimits:
        """These limits with `max_episode_tokens` resolved against a model's `context` (see `episode_tokens`),
        at most `EPISODE_TOKEN_LIMIT` (a model may declare a context longer than any episode is allowed)."""
        return dataclasses.replace(
            self, max_episode_tokens=min(self.episode_tokens(context), EPISODE_TOKEN_LIMIT)
        )
