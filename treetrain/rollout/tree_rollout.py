"""Tree rollouts: sample a group of episodes from the current policy along a fan-out schedule.

Each task seed's episode is reset, then its tree grows along the fan-out: at each policy branch point the
engine draws `FanOut.policy_factor` turns from the shared context, and after each turn the episode is forked
`FanOut.env_factor` ways and every copy is stepped by the `TokenEnv` wrapper, then sampled again. Every
task's tree grows at once on the `GenerationEngine` the caller passes (`treetrain.rollout.scheduler`:
every ready branch point of every tree in one batch, tool calls in a thread pool; the trainer makes it with
`treetrain.rollout.engines.factory`). With `concurrent=False` the trees grow one at a time, depth-first,
with the `Sampler` over the model (`treetrain.rollout.sequential`, the reference loop); under greedy
decoding both give the same trees.

Finished episodes become `Trajectory`s (rewarded by a rubric) and one `TrajectoryTree` per seed. Every
tree is built and written atomically to `<run_dir>/trees/` on one writer thread (`treetrain.rollout.tree_writer`),
beside generation, and every write is finished *before* `rollout_trees` returns, so nothing a trainer later
consumes exists only in memory.

One task ends alone: any exception of one task's episode (environment code failing in its worker, a
prompt longer than the episode budget, a chat template that refuses the conversation, any other error of
the token wrapper, in `reset` or later) ends that task's tree at once. The tree is not written, its group
is lost whole (a group is kept or dropped whole, so no normalization ever sees a group missing the
episodes that failed), its environments are released, and the failure is returned in
`RolloutResult.failures` with its traceback. The engine failing, a tree that cannot be written and
Ctrl-C stop the rollout.

Trajectory ids are `<env>-s<seed>/<branch path>`: the branch path lists the child taken at each branch
point (e.g. `calculator-s7/2.0.1`), which makes divergence points readable from the ids.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.env_error import EnvError
from envs.protocol import Environment, default_rubric
from envs.wrapper import TokenEnv, WrapperConfig
from treetrain.rollout.engines.generation import EngineStats, GenerationEngine
from treetrain.rollout.fanout import FanOut
from treetrain.rollout.prefix_sampler import Sampler, SamplerConfig
from treetrain.rollout.scheduler import InFlightSync, Scheduler, SchedulerConfig, Task, release
from treetrain.rollout.sequential import SequentialConfig, grow_sequentially
from treetrain.rollout.tree_writer import TreeWriter
from treetrain.tree import SamplingRecord, TrajectoryTree


@dataclass(frozen=True)
class RolloutConfig:
    """Everything that shapes a tree rollout besides the model and the environment."""

    fanout: FanOut = field(default_factory=FanOut)
    """Where and how wide episodes branch."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Temperature, top-p and seed of token sampling."""
    wrapper: WrapperConfig = field(default_factory=WrapperConfig)
    """Turn and token budgets and the step timeout."""
    concurrent: bool = True
    """Grow every task's tree at once on the engine passed in (False: one tree at a time with the reference
    loop over the model)."""
    max_concurrent_steps: int = 8
    """Most environment steps (tool calls) running at once."""
    rubric: str | None = None
    """Name of the environment rubric that gives rewards; None takes the environment's first."""
    model_version: int | None = None
    """Recorded in every trajectory's metadata (which weights sampled it)."""
    on_episode: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    """Called in the rollout's thread as each trajectory finishes: what the trainer's progress bar counts
    (it shapes nothing)."""


@dataclass(frozen=True)
class RolloutResult:
    """The trees of one rollout call, where they were written, the sampler's work counters, the tasks whose
    tree was lost to a failure (one `EnvError` each, with its seed), and how many environment steps missed
    their deadline."""

    trees: tuple[TrajectoryTree, ...]
    paths: tuple[Path, ...]
    stats: EngineStats
    failures: tuple[tuple[int, EnvError], ...] = ()
    step_timeouts: int = 0
    """Steps whose environment call missed `step_timeout_s` (each became a timeout observation)."""
    interrupted: int = 0
    """Samples stopped mid-turn for newer weights and resubmitted with their tokens so far."""


def rollout_trees(
    model: Any,
    tokenizer: Any,
    make_env: Callable[[], Environment],
    seeds: Sequence[int],
    run_dir: str | Path,
    config: RolloutConfig | None = None,
    env_name: str = "",
    engine: GenerationEngine | None = None,
    weights: InFlightSync | None = None,
) -> RolloutResult:
    """Roll out one tree per seed and write each to `<run_dir>/trees/` before returning.

    `make_env` builds a fresh environment (e.g. `lambda: envs.make_env("calculator")`). The model should
    be in eval mode; its weights are only read. `engine` serves the concurrent rollout (e.g.
    `HFEngine(model)`); the sequential loop (`concurrent=False`) samples from `model` itself. `weights`
    brings newer weights into the engine while the trees grow (`treetrain.rollout.weight_feed`).
    """
    config = config or RolloutConfig()
    if config.concurrent and engine is None:
        raise TypeError("rollout_trees: a concurrent rollout needs an engine (e.g. HFEngine(model))")
    trees_dir = Path(run_dir) / "trees"
    trees_dir.mkdir(parents=True, exist_ok=True)
    tasks: list[Task] = []
    failures: list[tuple[int, EnvError]] = []
    for seed in seeds:
        root: TokenEnv | None = None
        name = env_name or "env"
        try:
            env = make_env()
            name = env_name or type(env).__name__
            root = TokenEnv(env, tokenizer, config.wrapper, env_name=name)
            root.reset(seed)
            tasks.append(Task(seed, root, f"{name}-s{seed}", default_rubric(root.env, config.rubric)))
        except Exception as exc:  # this task alone: a long prompt, a template error, environment code
            if root is not None:
                release(root)
            failures.append((seed, EnvError.raised(name, "reset", exc)))
    sampling = config.sampler.sampling  # recorded in each tree: the trainer scores at its temperature
    writer = TreeWriter(trees_dir, SamplingRecord(sampling.temperature, sampling.top_p))

    def save(task: Task) -> None:  # as soon as a tree is complete: a later failure cannot lose it
        if engine is not None:
            engine.release_group(task.prefix)
        writer.put(tasks.index(task), task.prefix, task.trajectories())

    timeouts = interrupted = 0
    try:
        if config.concurrent:
            assert engine is not None
            stats, timeouts, interrupted = _grow_concurrently(tasks, config, engine, save, weights)
        else:
            stats = _grow_sequentially(model, tasks, config, save)
    finally:
        saved = writer.close()  # every tree finished so far is on disk, even when growing stopped early
    trees = tuple(saved[i][0] for i in sorted(saved))  # task order, whichever finished first
    paths = tuple(saved[i][1] for i in sorted(saved))
    failures += [(task.seed, task.failure) for task in tasks if task.failure is not None]
    failures.sort(key=lambda f: list(seeds).index(f[0]))
    return RolloutResult(trees, paths, stats, tuple(failures), timeouts, interrupted)


def _grow_concurrently(
    tasks: list[Task],
    config: RolloutConfig,
    engine: GenerationEngine,
    save: Callable[[Task], None],
    weights: InFlightSync | None,
) -> tuple[EngineStats, int, int]:
    """Grow `tasks` on `engine`: the engine's work, and the scheduler's step timeouts and interrupted samples."""
    before = copy.copy(engine.stats)
    settings = SchedulerConfig(
        config.fanout, config.sampler.sampling, max_concurrent_steps=config.max_concurrent_steps,
        model_version=config.model_version, base_seed=config.sampler.seed,
    )  # fmt: skip
    scheduler = Scheduler(
        engine, settings, on_finished=save, weights=weights, on_episode=config.on_episode or (lambda: None)
    )
    scheduler.run(tasks)
    for task in tasks:  # a finished task's group was released when its tree was saved
        if task.failure is not None:
            engine.release_group(task.prefix)
    return engine.stats.since(before), scheduler.step_timeouts, scheduler.interrupted


def _grow_sequentially(
    model: Any, tasks: list[Task], config: RolloutConfig, save: Callable[[Task], None]
) -> EngineStats:
    stats = EngineStats()
    seq = SequentialConfig(config.fanout, model_version=config.model_version)
    for task in tasks:
        sampler = Sampler(model, config.sampler, task.root.stop_sequences)
        try:
            grown = grow_sequentially(task.root, sampler, seq, task.prefix, task.rubric)
            task.finished = [(((0, i),), t) for i, t in enumerate(grown)]
            if config.on_episode is not None:  # the sequential loop finishes a whole tree at once
                for _ in grown:
                    config.on_episode()
        except Exception as exc:  # this task alone, as in the concurrent rollout
            release(task.root)
            task.failure = EnvError.raised(task.root.env_name, "step", exc)
        else:
            save(task)
        stats.encoded_tokens += sampler.stats.encoded_tokens
        stats.forward_calls += sampler.stats.forward_calls
        stats.sampled_tokens += sampler.stats.sampled_tokens
    return stats
