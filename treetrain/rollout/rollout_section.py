"""The `rollout` section of the training config: how each update's trees are sampled.

Typed and validated at load time, before any model loads (`treetrain.train.config.TrainConfig` holds it,
and nothing here imports torch); every bound here keeps a typo from sizing threads, trees or queues. The
engine settings (`engine`, `vllm`, `hf_kv_budget`) are read by the rollout alone: the tree sources turn
them into an `EngineSpec` (`treetrain.rollout.sources.engine_config`), and the trainer never looks at them.

Example:
    >>> RolloutSection(max_staleness=1).max_staleness
    1
    >>> RolloutSection(max_staleness=-1)
    Traceback (most recent call last):
    treetrain.errors.ConfigError: rollout.max_staleness: must be an integer in [0, 64], got -1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

from envs.wrapper import EpisodeLimits
from treetrain.errors import ConfigError
from treetrain.rollout.engines.engine_settings import VLLMSettings, check_engine_choice
from treetrain.rollout.fanout import FanOut
from treetrain.rollout.sampling import Sampling

MAX_GROUPS_PER_UPDATE = 1 << 16
"""Most advantage groups per update: trees are sampled and held for each, so a typo must not allocate
(`FanOut`, `Sampling` and `EpisodeLimits` bound their own fields)."""
MAX_CONCURRENT_STEPS = 1024
"""Most environment steps at once (a thread each)."""
MAX_STALENESS = 64
"""Largest `rollout.max_staleness`: the sampler holds that many updates' trees ahead of the trainer."""


RESUMABLE_ROLLOUT = (
    "max_staleness", "vllm.urls", "vllm.request_timeout_s", "vllm.transfer_host", "vllm.startup_wait_s",
)  # fmt: skip
"""`rollout` settings a resumed run may change: how far the sampler runs ahead, and the fleet it samples
on (a server gone for good left out, one added), which change where and when samples are drawn, never what
an update computes from them."""


@dataclass(frozen=True)
class RolloutSection:
    """Tree-shaped sampling from the current policy (ignored when `trees` is set)."""

    RENAMED_FIELDS: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "fanout_root": "fanout.root",
            "fanout_after_tool": "fanout.after_tool_result",
            "fanout_env": "fanout.after_assistant_turn",
            "max_branch_depth": "fanout.max_depth",
            "temperature": "sampling.temperature",
            "top_p": "sampling.top_p",
            "max_turns": "episode.max_turns",
            "max_turn_tokens": "episode.max_turn_tokens",
            "max_episode_tokens": "episode.max_episode_tokens",
            "step_timeout_s": "episode.step_timeout_s",
        }
    )
    """Keys of earlier config files and where they went: loading one names the new key."""

    groups_per_update: int = 4
    """Advantage groups per update: sampled trees (one task each, each its own group), or with `trees`
    recorded files (a file's trees are one group)."""
    fanout: FanOut = field(default_factory=FanOut)
    """Where and how wide episodes branch (treetrain.rollout.fanout.FanOut, which the rollout takes as is)."""
    sampling: Sampling = field(default_factory=Sampling)
    """Temperature and top-p of token sampling (treetrain.rollout.sampling.Sampling, which the sampler takes
    as is, with a seed per task). The loss scores at this temperature; with `trees`, a tree that recorded
    its sampling must match it."""
    episode: EpisodeLimits = field(default_factory=EpisodeLimits)
    """Turn and token budgets and the step timeout of one episode (envs.wrapper.EpisodeLimits, which the
    token wrapper takes as is, a null `max_episode_tokens` resolved to the model's context)."""
    trees: str | None = None
    """Train on recorded trees instead: a directory or glob of .msgpack files, consumed in order."""
    engine: str = "hf"
    """Which inference engine samples the rollouts: 'hf' (the model being trained, continuous batching),
    'vllm' (vLLM in this process, weights copied in after every optimizer step) or 'vllm-server' (`vllm serve`
    processes at `vllm.urls`, weights reloaded from the run directory); docs/rollout-engines.md."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    """How the vllm engine starts and the vllm-server engine connects (treetrain.rollout.engines.engine_settings)."""
    max_concurrent_steps: int = 8
    """Most environment steps (tool calls) running at once, in threads, while generation goes on."""
    env_workers: int | None = None
    """Environment worker processes per trainer process. A worker that dies ends the groups of every task
    it hosts, so the default (null) gives each task of an update its own worker, up to 16."""
    hf_kv_budget: str | None = None
    """Most KV-cache bytes the 'hf' engine holds during a rollout, live rows and kept prefixes together, e.g.
    '2GiB' (null: a quarter of memory_budget, or of the device's memory; under ZeRO-3 with max_staleness >= 1,
    whose sampler runs on the CPU beside training, a quarter of the host's free memory at start). Requests
    wait while admitting them would exceed it (one always runs); kept prefixes are dropped oldest first."""
    rubric_timeout_s: float | None = 300.0
    """Seconds a rubric (the reward of one finished episode, scored in its environment worker) may take
    before that task's group is dropped; null waits forever. Apart from the step timeout, because code
    execution and judge rewards take far longer than a tool call."""
    max_staleness: int = 0
    """How many optimizer steps older than the trainer's weights a trained token's sampling weights may be.
    0: rollout and training take turns (the rollout of update n+1 starts after the step of update n). K >= 1:
    a sampler thread grows the rollouts of the next updates while the current one trains, taking new weights
    between its engine steps, paced so that every token update u trains on was sampled by a version of at
    least (the trainer's version) - K; groups over the bound are dropped and counted
    (docs/async-training.md). May be changed on --resume."""
    max_failed_fraction: float = 0.5
    """Largest fraction of an update's tasks that environment code may fail in (an exception in reset,
    step, fork or a rubric, or a worker that died) before the run stops. A failed task's group is dropped
    and training goes on; an update where every task fails always stops (docs/environments.md)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ConfigError(
                f"rollout.max_failed_fraction: must be in [0, 1], got {self.max_failed_fraction}"
            )
        if not 1 <= self.groups_per_update <= MAX_GROUPS_PER_UPDATE:
            raise ConfigError(
                f"rollout.groups_per_update: must be in [1, {MAX_GROUPS_PER_UPDATE}], got {self.groups_per_update}"
            )
        if self.sampling.greedy:
            raise ConfigError(
                "rollout.sampling.temperature: must be > 0 for RL sampling (0 is greedy decoding), got 0"
            )
        check_engine_choice(self.engine, self.vllm)
        if self.hf_kv_budget is not None:
            from treetrain.bytesize import parse_bytes

            try:
                if parse_bytes(self.hf_kv_budget) <= 0:
                    raise ValueError("must be positive")
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"rollout.hf_kv_budget: {exc}") from None
        timeout = self.rubric_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 7 * 86400
        ):
            raise ConfigError(
                f"rollout.rubric_timeout_s: must be in (0, 604800] seconds or null (no timeout), got {timeout!r}"
            )
        workers = self.env_workers
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64
        ):
            raise ConfigError(f"rollout.env_workers: must be null or an integer in [1, 64], got {workers!r}")
        k = self.max_staleness
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_STALENESS:
            raise ConfigError(f"rollout.max_staleness: must be an integer in [0, {MAX_STALENESS}], got {k!r}")
        if k and self.engine == "vllm-server" and self.vllm.weight_sync == "gloo":
            raise ConfigError(
                "rollout.vllm.weight_sync: gloo streams the live weights between updates, and with "
                "rollout.max_staleness >= 1 the servers take each version while the trainer steps on, from "
                "the files it published; set rollout.vllm.weight_sync=files (or rollout.max_staleness=0)"
            )
        steps = self.max_concurrent_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_CONCURRENT_STEPS:
            raise ConfigError(
                f"rollout.max_concurrent_steps: must be an integer in [1, {MAX_CONCURRENT_STEPS}], got {steps!r}"
            )

    def check_sharded_weights(self) -> None:
        """Refuse, in one line, an asynchronous run whose sampler would keep a whole copy of the policy on
        every rank whose weights ZeRO-3 shards. `vllm-server`'s servers hold the weights, and `hf` samples on
        rank 0 alone, from one shadow filled module by module (`treetrain.rollout.gathered_feed`); `vllm`
        loads the weights into an engine on every rank."""
        if self.max_staleness and self.engine == "vllm":
            raise ConfigError(
                "rollout.max_staleness: with rollout.engine='vllm' each rank's engine keeps a whole copy of the "
                "policy's weights, which ZeRO-3 shards so that no rank holds them; use "
                "rollout.engine='vllm-server' (the servers hold the weights), 'hf' (one sampler process on "
                "rank 0), distributed.zero_stage <= 2, or rollout.max_staleness=0"
            )
