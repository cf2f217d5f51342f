"""Tree rollouts: sample a group of episodes from the current policy along a fan-out schedule.

Each task seed's episode is reset, then its tree grows along the fan-out: at each policy branch point the
engine draws `FanOut.policy_factor` turns from the shared context, and after each turn the episode is forked
`FanOut.env_factor` ways and every copy is stepped by the `TokenEnv` wrapper, then sampled again. By
default every task's tree grows at once on a `GenerationEngine` (`treetrain.rollout.scheduler`: every ready
branch point of every tree in one batch, tool calls in a thread pool). With `concurrent=False` the trees grow
one at a time, depth-first, with the `Sampler` (`treetrain.rollout.sequential`, the reference loop); under
greedy decoding both give the same trees.

Finished episodes become `Trajectory`s (rewarded by a rubric) and one `TrajectoryTree` per seed. Every
tree is written atomically to `<run_dir>/trees/` *before* `rollout_trees` returns, so nothing a trainer
later consumes exists only in memory.

Environment code that fails (`envs.remote.EnvFailure`, raised by environments hosted in worker processes:
an exception in `reset`, `step`, `fork` or a rubric, or a dead worker) ends that task's tree at once: the
tree is not written, its group is lost whole (a group is kept or dropped whole, so no normalization ever
sees a group missing the episodes that failed), and the failure is returned in `RolloutResult.failures`.
An in-process environment's errors propagate to the caller.

Trajectory ids are `<env>-s<seed>/<branch path>`: the branch path lists the child taken at each branch
point (e.g. `calculator-s7/2.0.1`), which makes divergence points readable from the ids.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.protocol import Environment, default_rubric
from envs.remote import EnvError, EnvFailure
from envs.wrapper import TokenEnv, WrapperConfig
from treetrain.rollout.engines.generation import EngineStats, GenerationEngine
from treetrain.rollout.fanout import FanOut
from treetrain.rollout.prefix_sampler import Sampler, SamplerConfig
from treetrain.rollout.scheduler import Scheduler, Task, release
from treetrain.rollout.sequential import SequentialConfig, grow_sequentially
from treetrain.tree import SamplingRecord, TrajectoryTree
from treetrain.tree.build import build_tree
from treetrain.tree.format import save_tree


@dataclass(frozen=True)
class RolloutConfig:
    """Everything that shapes a tree rollout besides the model and the environment."""

    fanout: FanOut = field(default_factory=FanOut)
    """Where and how wide episodes branch."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Temperature, top-p and seed of token sampling."""
    wrapper: WrapperConfig = field(default_factory=WrapperConfig)
    """Turn and token budgets and the step timeout."""
    reuse_prefix_kv: bool = True
    """Keep each branch point's KV for its children instead of re-encoding the context (the `HFEngine` made
    here and the sequential loop; other engines keep their own prefix cache)."""
    concurrent: bool = True
    """Grow every task's tree at once on an engine (False: one tree at a time with the reference loop)."""
    max_concurrent_steps: int = 8
    """Most environment steps (tool calls) running at once."""
    rubric: str | None = None
    """Name of the environment rubric that gives rewards; None takes the environment's first."""
    model_version: int | None = None
    """Recorded in every trajectory's metadata (which weights sampled it)."""


@dataclass(frozen=True)
class RolloutResult:
    """The trees of one rollout call, where they were written, the sampler's work counters, and the tasks
    whose tree was lost to a failure of environment code (one `EnvError` each, with its seed)."""

    trees: tuple[TrajectoryTree, ...]
    paths: tuple[Path, ...]
    stats: EngineStats
    failures: tuple[tuple[int, EnvError], ...] = ()


def portable_name(text: str) -> str:
    """`text` with every character outside `[A-Za-z0-9._-]` replaced by `_`, so a file name made from an
    environment name (`my_pkg.envs:Maze`) is valid on every filesystem.

        >>> portable_name("my_pkg.envs:Maze-s3")
        'my_pkg.envs_Maze-s3'
    """
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def rollout_trees(
    model: Any,
    tokenizer: Any,
    make_env: Callable[[], Environment],
    seeds: Sequence[int],
    run_dir: str | Path,
    config: RolloutConfig | None = None,
    env_name: str = "",
    engine: GenerationEngine | None = None,
) -> RolloutResult:
    """Roll out one tree per seed and write each to `<run_dir>/trees/` before returning.

    `make_env` builds a fresh environment (e.g. `lambda: envs.make_env("calculator")`). The model should
    be in eval mode; its weights are only read. `engine` serves the concurrent rollout (default: an
    `HFEngine` over `model`); the sequential loop always samples from `model` itself.
    """
    config = config or RolloutConfig()
    trees_dir = Path(run_dir) / "trees"
    trees_dir.mkdir(parents=True, exist_ok=True)
    tasks: list[Task] = []
    failures: list[tuple[int, EnvError]] = []
    for seed in seeds:
        root: TokenEnv | None = None
        try:
            env = make_env()
            name = env_name or type(env).__name__
            root = TokenEnv(env, tokenizer, config.wrapper, env_name=name)
            root.reset(seed)
            tasks.append(Task(seed, root, f"{name}-s{seed}", default_rubric(root.env, config.rubric)))
        except EnvFailure as failure:
            if root is not None:
                release(root)
            failures.append((seed, failure.error))
    if config.concurrent and engine is None:
        from treetrain.rollout.engines.hf_engine import HFEngine

        engine = HFEngine(model, version=config.model_version or 0, keep_prefixes=config.reuse_prefix_kv)
    saved: dict[int, tuple[TrajectoryTree, Path]] = {}  # by task index
    sampling = config.sampler.sampling  # recorded in each tree: the trainer scores at its temperature

    def save(task: Task) -> None:  # as soon as a tree is complete: a later failure cannot lose it
        if engine is not None:
            engine.release_group(task.prefix)
        tree = build_tree(task.trajectories(), SamplingRecord(sampling.temperature, sampling.top_p))
        path = trees_dir / f"{portable_name(task.prefix)}-{tree.id[:12]}.msgpack"
        save_tree(tree, path)
        saved[tasks.index(task)] = (tree, path)

    if config.concurrent:
        assert engine is not None
        stats = _grow_concurrently(tasks, config, engine, save)
    else:
        stats = _grow_sequentially(model, tasks, config, save)
    trees = tuple(saved[i][0] for i in sorted(saved))  # task order, whichever finished first
    paths = tuple(saved[i][1] for i in sorted(saved))
    failures += [(task.seed, task.failure) for task in tasks if task.failure is not None]
    failures.sort(key=lambda f: list(seeds).index(f[0]))
    return RolloutResult(trees, paths, stats, tuple(failures))


def _grow_concurrently(
    tasks: list[Task], config: RolloutConfig, engine: GenerationEngine, save: Callable[[Task], None]
) -> EngineStats:
    before = copy.copy(engine.stats)
    scheduler = Scheduler(
        engine, config.fanout, config.sampler.sampling, max_concurrent_steps=config.max_concurrent_steps,
        model_version=config.model_version, base_seed=config.sampler.seed, on_finished=save,
    )  # fmt: skip
    scheduler.run(tasks)
    for task in tasks:  # a finished task's group was released when its tree was saved
        if task.failure is not None:
            engine.release_group(task.prefix)
    return engine.stats.since(before)


def _grow_sequentially(
    model: Any, tasks: list[Task], config: RolloutConfig, save: Callable[[Task], None]
) -> EngineStats:
    stats = EngineStats()
    seq = SequentialConfig(config.fanout, config.reuse_prefix_kv, config.model_version)
    for task in tasks:
        sampler = Sampler(model, config.sampler, task.root.stop_sequences)
        try:
            grown = grow_sequentially(task.root, sampler, seq, task.prefix, task.rubric)
            task.finished = [(((0, i),), t) for i, t in enumerate(grown)]
        except EnvFailure as failure:
            release(task.root)
            task.failure = failure.error
        else:
            save(task)
        stats.encoded_tokens += sampler.stats.encoded_tokens
        stats.forward_calls += sampler.stats.forward_calls
        stats.sampled_tokens += sampler.stats.sampled_tokens
    return stats
