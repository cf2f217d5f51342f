"""The fan-out schedule of a tree rollout: where an episode branches, and how wide.

There are two kinds of branch point:

- *policy* branches: the model samples several continuations of the same context. The root (after the
  prompt) always branches `root` ways (G in GRPO terms); after each tool result or other observation the
  next assistant turn branches `after_tool_result` ways;
- *environment* branches: after an assistant turn the environment is forked `after_assistant_turn`
  ways and each copy answers the same turn. Copies of a deterministic environment answer identically,
  so their tokens merge in the tree and they differ from their next policy branch on; a stochastic
  environment (one that reseeds in `Environment.fork`) gives different observations.

`max_depth` bounds the number of branch points (of either kind, the root included) on one root-to-leaf
path; past it every factor is 1. This bounds the trajectories per tree (`max_leaves`), which is checked
against `max_trajectories` when the schedule is built.

`FanOut` is also the trainer's `rollout.fanout` config section, as it is: its defaults are the demo's and
its field names are the config's keys (`--set rollout.fanout.after_assistant_turn=2`).

Example:
    >>> FanOut(root=3, after_tool_result=2, max_depth=2).max_leaves
    6
"""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.errors import ConfigError

FACTOR_LIMIT = 1 << 12
"""Most samples or forks at one branch point: a batch is sized from it, so a typo must not allocate."""
DEPTH_LIMIT = 64
"""Most branch points on one path."""
TRAJECTORY_LIMIT = 1 << 16
"""Largest `max_trajectories` accepted."""


@dataclass(frozen=True)
class FanOut:
    """How a tree rollout branches; the trainer's `rollout.fanout` section. See the module docstring.

    Errors name the field alone (`root: ...`); the config loader puts the section in front.
    """

    root: int = 8
    """G: samples of the first assistant turn."""
    after_tool_result: int = 1
    """Samples of the next assistant turn after each observation (tool results, user replies)."""
    after_assistant_turn: int = 1
    """Environment forks that each answer the same assistant turn."""
    max_depth: int = 2
    """Most branch points with a factor above 1 on one path, the root included."""
    max_trajectories: int = 256
    """Upper bound on trajectories per tree; a schedule that could exceed it is refused."""

    def __post_init__(self) -> None:
        limits = {
            "root": FACTOR_LIMIT, "after_tool_result": FACTOR_LIMIT, "after_assistant_turn": FACTOR_LIMIT,
            "max_depth": DEPTH_LIMIT, "max_trajectories": TRAJECTORY_LIMIT,
        }  # fmt: skip
        for name, most in limits.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"must be an integer, got {value!r}", field=name)
            if not 1 <= value <= most:
                raise ConfigError(f"must be in [1, {most}], got {value}", field=name)
        if self.max_leaves > self.max_trajectories:
            raise ConfigError(
                f"the schedule can produce up to {self.max_leaves} trajectories per tree, more than this "
                f"limit of {self.max_trajectories}; raise it, or lower a factor or max_depth",
                field="max_trajectories",
            )

    @property
    def max_leaves(self) -> int:
        """The most trajectories one tree can hold under this schedule."""
        later = self.max_depth - (1 if self.root > 1 else 0)
        return self.root * max(self.after_tool_result, self.after_assistant_turn) ** later

    def policy_factor(self, depth: int, at_root: bool) -> int:
        """Samples to draw at a policy branch point reached after `depth` branch points."""
        if at_root:
            return self.root
        return self.after_tool_result if depth < self.max_depth else 1

    def env_factor(self, depth: int) -> int:
        """Environment forks after an assistant turn reached after `depth` branch points."""
        return self.after_assistant_turn if depth < self.max_depth else 1
