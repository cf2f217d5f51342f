"""Tree rollouts: sample a group of episodes from the current policy along a fan-out schedule.

For each task seed, one episode is reset, then grown depth-first. At each policy branch point the
`Sampler` draws `FanOut.policy_factor` turns from the shared context in one batch. After each turn the
episode is forked `FanOut.env_factor` ways and every copy is stepped by the `TokenEnv` wrapper, then
sampled again. Each branch keeps the KV of its context (`reuse_prefix_kv=True`), so a child encodes
only its own new tokens: the previous turn's last token and the observation. With reuse off, every
turn re-encodes the whole context; the tokens are the same (tests check it under greedy decoding).

Finished episodes become `Trajectory`s (rewarded by a rubric) and one `TrajectoryTree` per seed. Every
tree is written atomically to `<run_dir>/trees/` *before* `rollout_trees` returns, so nothing a trainer
later consumes exists only in memory.

Environment code that fails (`envs.remote.EnvFailure`, raised by environments hosted in worker processes:
an exception in `reset`, `step`, `fork` or a rubric, or a dead worker) ends that task's tree at once: the
tree is not written, its group is lost whole (a group is kept or dropped whole, so no normalization ever
sees a group missing the episodes that failed), and the failure is returned in `RolloutResult.failures`.
An in-process environment's errors propagate as before.

Trajectory ids are `<env>-s<seed>/<branch path>`: the branch path lists the child taken at each branch
point (e.g. `calculator-s7/2.0.1`), which makes divergence points readable from the ids.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.protocol import Environment, Rubric, default_rubric
from envs.remote import EnvError, EnvFailure, RemoteEnv
from envs.wrapper import TokenEnv, WrapperConfig
from treetrain.rollout.fanout import FanOut
from treetrain.rollout.sampler import PrefixState, Sample, Sampler, SamplerConfig, SamplerStats, fork_cache
from treetrain.trajectory import Trajectory
from treetrain.tree import TrajectoryTree
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
    """Keep each branch point's KV for its children instead of re-encoding the context."""
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
    stats: SamplerStats
    failures: tuple[tuple[int, EnvError], ...] = ()


@dataclass
class _Branch:
    """A policy branch point waiting to be sampled."""

    episode: TokenEnv
    state: PrefixState | None
    pending: tuple[int, ...]
    depth: int
    path: tuple[int, ...]
    at_root: bool = False


def _grow(
    root: TokenEnv, sampler: Sampler, config: RolloutConfig, prefix: str, rubric: Rubric | None
) -> list[Trajectory]:
    finished: list[Trajectory] = []
    stack = [_Branch(root, None, root.context, 0, (), at_root=True)]
    try:
        while stack:
            _grow_one(stack.pop(), stack, finished, sampler, config, prefix, rubric)
    finally:  # on success the stack is empty; on a failure every live episode is freed
        for branch in stack:
            _release(branch.episode)
    return finished


def _release(episode: TokenEnv) -> None:
    """Free a worker-hosted environment once its episode needs it no more."""
    if isinstance(episode.env, RemoteEnv):
        episode.env.release()


def _grow_one(
    branch: _Branch,
    stack: list[_Branch],
    finished: list[Trajectory],
    sampler: Sampler,
    config: RolloutConfig,
    prefix: str,
    rubric: Rubric | None,
) -> None:
    """Sample one branch point, step its forks, score the finished ones and push the rest."""
    fan, reuse = config.fanout, config.reuse_prefix_kv
    children: list[_Branch] = []
    try:
        n = fan.policy_factor(branch.depth, branch.at_root)
        depth = branch.depth + (n > 1)
        budget = branch.episode.turn_budget()
        if branch.state is None:  # nothing kept (the root, or reuse off): encode the whole context
            samples = sampler.sample(None, branch.episode.context, n, budget, keep_state=reuse)
        else:
            if branch.state.length + len(branch.pending) != len(branch.episode.context):
                raise RuntimeError(
                    f"kept KV covers {branch.state.length} tokens + {len(branch.pending)} pending, "
                    f"but the context has {len(branch.episode.context)}"
                )
            samples = sampler.sample(branch.state, branch.pending, n, budget)
        for i, sample in enumerate(samples):
            path = (*branch.path, i) if n > 1 else branch.path
            _step_forks(branch.episode, sample, fan.env_factor(depth), depth, path, reuse, children)
        for child in children:
            if child.episode.done:
                tid = f"{prefix}/{'.'.join(map(str, child.path)) or '0'}"
                finished.append(child.episode.trajectory(tid, rubric, config.model_version))
    except BaseException:
        for child in children:
            _release(child.episode)
        raise
    finally:
        _release(branch.episode)
    for child in children:
        if child.episode.done:
            _release(child.episode)
    stack.extend(reversed([c for c in children if not c.episode.done]))


def _step_forks(
    parent: TokenEnv,
    sample: Sample,
    k: int,
    depth: int,
    path: tuple[int, ...],
    reuse: bool,
    out: list[_Branch],
) -> None:
    """Fork the episode `k` ways (1: a single copy), step each copy with `sample`, add the branches to
    `out` (each as soon as it exists, so that a failure can free it)."""
    for j in range(k):
        episode = parent.fork(branch=j)
        out.append(_Branch(episode, None, (), depth, path))
        result = episode.step(sample.tokens, sample.logprobs)
        state: PrefixState | None = None  # None: the child encodes its whole context (also a new call)
        if reuse and sample.state is not None and not result.done and not result.new_call:
            cache = sample.state.cache if j == k - 1 else fork_cache(sample.state.cache, [0])
            state = PrefixState(cache, sample.state.length)
        pending = (sample.tokens[-1], *result.observation)
        out[-1] = _Branch(episode, state, pending, depth + (k > 1), (*path, j) if k > 1 else path)


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
) -> RolloutResult:
    """Roll out one tree per seed and write each to `<run_dir>/trees/` before returning.

    `make_env` builds a fresh environment (e.g. `lambda: envs.make_env("calculator")`). The model should
    be in eval mode; its weights are only read.
    """
    config = config or RolloutConfig()
    trees_dir = Path(run_dir) / "trees"
    trees_dir.mkdir(parents=True, exist_ok=True)
    trees: list[TrajectoryTree] = []
    paths: list[Path] = []
    sampler: Sampler | None = None
    failures: list[tuple[int, EnvError]] = []
    for seed in seeds:
        root: TokenEnv | None = None
        try:
            env = make_env()
            name = env_name or type(env).__name__
            root = TokenEnv(env, tokenizer, config.wrapper, env_name=name)
            root.reset(seed)
            if sampler is None:
                sampler = Sampler(model, config.sampler, root.stop_sequences)
            rubric = default_rubric(root.env, config.rubric)
            prefix = f"{name}-s{seed}"
            grown = _grow(root, sampler, config, prefix, rubric)
        except EnvFailure as failure:
            if root is not None:
                _release(root)
            failures.append((seed, failure.error))
            continue
        tree = build_tree(grown)
        path = trees_dir / f"{portable_name(prefix)}-{tree.id[:12]}.msgpack"
        save_tree(tree, path)
        trees.append(tree)
        paths.append(path)
    stats = sampler.stats if sampler else SamplerStats()
    return RolloutResult(tuple(trees), tuple(paths), stats, tuple(failures))
