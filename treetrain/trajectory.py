"""Trajectories: the token ids of one agent episode, split into role-tagged segments.

An episode is one or more LLM *calls*. Usually there is one call whose context grows turn by turn
(prompt, policy, observation, policy, ...). Agents that rewrite their history (summarise, drop earlier
reasoning) make several calls whose contexts are not extensions of one another: each call is then its own
token sequence. Tokens are never re-derived from text; the ids here are the ids the sampler saw.

Ownership: a policy token carries loss exactly once per trajectory. When two calls of one trajectory share
the same (token, role) prefix, the shared policy tokens are owned by the earliest such call and carry no
loss in the later ones. The tree gets the same result structurally, because a node records the *set* of
trajectories through it; `owned_policy_mask` states the rule for the flat reference.

Example:
    >>> traj = Trajectory(
    ...     id="ep0",
    ...     calls=(Call((Segment(Role.PROMPT, (1, 2, 3)), Segment(Role.POLICY, (4, 5), (-0.1, -0.2)))),),
    ...     reward=1.0,
    ... )
    >>> traj.num_tokens, traj.num_policy_tokens
    (5, 2)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import SupportsFloat

from treetrain.errors import TreetrainError


class TrajectoryError(TreetrainError, ValueError):
    """An invalid trajectory: the message names the trajectory, call, segment and field."""


class Role(str, Enum):
    """Who produced a token, which decides whether it carries loss."""

    PROMPT = "prompt"
    POLICY = "policy"
    OBSERVATION = "observation"

    @property
    def code(self) -> int:
        """Compact integer code used in files and tensors."""
        return _ROLE_CODES[self]

    @staticmethod
    def from_code(code: int) -> Role:
        try:
            return _ROLES_BY_CODE[code]
        except KeyError:
            raise ValueError(f"unknown role code {code!r}; known: {sorted(_ROLES_BY_CODE)}") from None


_ROLE_CODES = {Role.PROMPT: 0, Role.POLICY: 1, Role.OBSERVATION: 2}
_ROLES_BY_CODE = {v: k for k, v in _ROLE_CODES.items()}


@dataclass(frozen=True)
class Segment:
    """A run of tokens with one role.

    `logprobs` are the sampler's log-probabilities of the tokens; only policy segments have them, and
    they are optional (imported rollouts sometimes lack them; the loss can then use the scoring pass).
    `version` is the weight version that sampled the tokens (`Completion.version`), so a trainer can tell
    how stale they are; only policy segments have one, and it is None when unknown (imported, older files).
    """

    role: Role
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    version: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            try:
                object.__setattr__(self, "role", Role(self.role))
            except ValueError:
                raise TrajectoryError(
                    f"segment role {self.role!r} is not one of {[r.value for r in Role]}"
                ) from None
        object.__setattr__(self, "tokens", tuple(self.tokens))
        if not self.tokens:
            raise TrajectoryError(f"{self.role.value} segment has no tokens")
        for t in self.tokens:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise TrajectoryError(f"{self.role.value} segment token {t!r} is not a non-negative int")
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
            if self.role is not Role.POLICY:
                raise TrajectoryError(
                    f"{self.role.value} segment has sampler logprobs; only policy segments may"
                )
            assert self.logprobs is not None
            if len(self.logprobs) != len(self.tokens):
                raise TrajectoryError(
                    f"policy segment has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs"
                )
            for x in self.logprobs:
                if not math.isfinite(x) or x > 0.0:
                    raise TrajectoryError(f"policy segment logprob {x!r} is not a finite value <= 0")

        if self.version is not None:
            if self.role is not Role.POLICY:
                raise TrajectoryError(
                    f"{self.role.value} segment has a weight version; only policy segments may"
                )
            if (
                isinstance(self.version, bool)
                or not isinstance(self.version, int)
                or not 0 <= self.version <= VERSION_LIMIT
            ):
                raise TrajectoryError(f"policy segment version {self.version!r} is not an int in [0, 2**63)")

    def __len__(self) -> int:
        return len(self.tokens)


VERSION_LIMIT = (1 << 63) - 1
"""Largest weight version accepted: versions count optimizer steps, and files store them as msgpack int64."""


@dataclass(frozen=True)
class Call:
    """One LLM call: a single token sequence fed to the model (context plus what it generated)."""

    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        if not self.segments:
            raise TrajectoryError("call has no segments")
        for s in self.segments:
            if not isinstance(s, Segment):
                raise TrajectoryError(f"call segment {s!r} is not a Segment")
        if self.segments[0].role is Role.POLICY:
            raise TrajectoryError(
                "call starts with a policy segment: a sequence's first token is never predicted, so it cannot "
                "carry loss; put the context (at least a BOS prompt token) before the generated tokens"
            )

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(t for s in self.segments for t in s.tokens)

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(s.role for s in self.segments for _ in s.tokens)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def num_policy_tokens(self) -> int:
        return sum(len(s) for s in self.segments if s.role is Role.POLICY)

    def sampler_logprobs(self) -> tuple[float, ...] | None:
        """Per-token sampler logprobs (NaN off policy), or None when any policy segment lacks them."""
        out: list[float] = []
        for s in self.segments:
            if s.role is Role.POLICY:
                if s.logprobs is None:
                    return None
                out.extend(s.logprobs)
            else:
                out.extend([math.nan] * len(s))
        return tuple(out)


@dataclass(frozen=True)
class TrajectoryMeta:
    """Where a trajectory came from. `extra` holds free-form string tags (task id, sampler, ...).

    `model_version` is the weight version the rollout expected when it ran the episode (the trainer's
    version then), not a summary of the tokens: each policy segment records the version that actually
    sampled it (`Segment.version`), and a long episode may span several.
    """

    env: str = ""
    seed: int | None = None
    model_version: int | None = None
    extra: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        extra = dict(self.extra)
        for k, v in extra.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TrajectoryError(f"metadata extra entry {k!r}: {v!r} must map str to str")
        object.__setattr__(self, "extra", MappingProxyType(extra))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrajectoryMeta):
            return NotImplemented
        return (self.env, self.seed, self.model_version, dict(self.extra)) == (
            other.env,
            other.seed,
            other.model_version,
            dict(other.extra),
        )

    def __hash__(self) -> int:
        return hash((self.env, self.seed, self.model_version, tuple(sorted(self.extra.items()))))


REWARD_LIMIT = 1e15
"""Largest reward magnitude accepted. Advantages subtract and divide rewards in float64 and the loss weighs
float32 logprobs by them; far below either range's edge, and far above any reward an environment means."""


def check_reward(value: object, where: str) -> float:
    """`value` as a float reward, or a TrajectoryError naming `where`; every way a reward enters uses it.

    >>> check_reward(3, "reward")
    3.0
    >>> check_reward(10**400, "reward")
    Traceback (most recent call last):
    ...
    treetrain.trajectory.TrajectoryError: reward is inf; rewards must be finite and within +-1e+15
    """
    # Python and numpy numbers, and one-element tensors (they define __float__); never text or bool.
    try:
        out = float(value) if isinstance(value, SupportsFloat) and not isinstance(value, bool) else None
    except OverflowError:
        out = math.inf
    except (TypeError, ValueError, RuntimeError):
        out = None
    if out is None:
        raise TrajectoryError(f"{where} {value!r:.40} is not a number")
    if not math.isfinite(out) or abs(out) > REWARD_LIMIT:
        raise TrajectoryError(f"{where} is {out!r}; rewards must be finite and within +-{REWARD_LIMIT:g}")
    return out


@dataclass(frozen=True)
class Trajectory:
    """One episode: its calls, its final reward, and optional per-step rewards.

    `step_rewards`, when given, has one entry per policy segment across all calls, in order; tree-aware
    advantages and per-turn credit use them. `reward` must be finite.
    """

    id: str
    calls: tuple[Call, ...]
    reward: float
    step_rewards: tuple[float, ...] = ()
    meta: TrajectoryMeta = field(default_factory=TrajectoryMeta)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise TrajectoryError(f"trajectory id {self.id!r} must be a non-empty string")
        object.__setattr__(self, "calls", tuple(self.calls))
        if not self.calls:
            raise TrajectoryError(f"trajectory {self.id!r} has no calls")
        object.__setattr__(self, "reward", check_reward(self.reward, f"trajectory {self.id!r} reward"))
        object.__setattr__(
            self,
            "step_rewards",
            tuple(
                check_reward(r, f"trajectory {self.id!r} step_rewards[{i}]")
                for i, r in enumerate(self.step_rewards)
            ),
        )
        if self.step_rewards:
            n_turns = sum(1 for c in self.calls for s in c.segments if s.role is Role.POLICY)
            if len(self.step_rewards) != n_turns:
                raise TrajectoryError(
                    f"trajectory {self.id!r} has {len(self.step_rewards)} step_rewards but {n_turns} policy segments"
                )
        # Every policy token is owned by some call, so this is `num_policy_tokens == 0` without the
        # prefix scans that cost calls^2 x tokens.
        if not any(s.role is Role.POLICY for c in self.calls for s in c.segments):
            raise TrajectoryError(f"trajectory {self.id!r} has no policy tokens, so nothing to train on")

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.calls)

    @property
    def versions(self) -> tuple[int, ...]:
        """The distinct weight versions that sampled this trajectory's policy tokens, ascending (unknown
        ones left out)."""
        found = {s.version for c in self.calls for s in c.segments if s.version is not None}
        return tuple(sorted(found))

    @property
    def num_policy_tokens(self) -> int:
        """Policy tokens counted once each under the ownership rule."""
        return sum(sum(self.owned_policy_mask(i)) for i in range(len(self.calls)))

    def owned_policy_mask(self, call_index: int) -> tuple[bool, ...]:
        """Which tokens of call `call_index` carry this trajectory's loss.

        A policy token is owned by the earliest call whose (token, role) prefix up to and including that
        token is identical. The tree merge gives the same answer; tests check they agree.
        """
        call = self.calls[call_index]
        toks, roles = call.tokens, call.roles
        shared = 0
        for earlier in self.calls[:call_index]:
            et, er = earlier.tokens, earlier.roles
            n = 0
            for a, b, ra, rb in zip(toks, et, roles, er):
                if a != b or ra is not rb:
                    break
                n += 1
            shared = max(shared, n)
        return tuple(r is Role.POLICY and i >= shared for i, r in enumerate(roles))
