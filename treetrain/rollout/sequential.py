"""The sequential reference loop: one tree at a time, depth-first, one branch point at a time.

The reference the concurrent scheduler (`treetrain.rollout.scheduler`) is checked against (under greedy decoding both give identical trees) and as the
baseline of `bench/rollout_engines.py`. At each policy branch point the `Sampler` draws
`FanOut.policy_factor` turns from the shared context in one batch; after each turn the episode is forked
`FanOut.env_factor` ways and every copy is stepped, one after another. Each branch keeps the KV of its
context (`reuse_prefix_kv=True`), so a child encodes only its own new tokens: the previous turn's last token
and the observation.
"""

from __future__ import annotations

from dataclasses import dataclass

from envs.protocol import Rubric
from envs.wrapper import TokenEnv
from treetrain.rollout.fanout import FanOut
from treetrain.rollout.prefix_sampler import PrefixState, Sample, Sampler, fork_cache
from treetrain.rollout.scheduler import release
from treetrain.trajectory import Trajectory


@dataclass(frozen=True)
class SequentialConfig:
    """What the sequential loop needs besides the sampler."""

    fanout: FanOut
    reuse_prefix_kv: bool = True
    """Keep each branch point's KV for its children instead of re-encoding the context."""
    model_version: int | None = None


@dataclass
class _Branch:
    """A policy branch point waiting to be sampled."""

    episode: TokenEnv
    state: PrefixState | None
    pending: tuple[int, ...]
    depth: int
    path: tuple[int, ...]
    at_root: bool = False


def grow_sequentially(
    root: TokenEnv, sampler: Sampler, config: SequentialConfig, prefix: str, rubric: Rubric | None
) -> list[Trajectory]:
    """Every trajectory of the tree rooted at `root` (reset already), grown depth-first."""
    finished: list[Trajectory] = []
    stack = [_Branch(root, None, root.context, 0, (), at_root=True)]
    try:
        while stack:
            _grow_one(stack.pop(), stack, finished, sampler, config, prefix, rubric)
    finally:  # on success the stack is empty; on a failure every live episode is freed
        for branch in stack:
            release(branch.episode)
    return finished


def _grow_one(
    branch: _Branch,
    stack: list[_Branch],
    finished: list[Trajectory],
    sampler: Sampler,
    config: SequentialConfig,
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
            release(child.episode)
        raise
    finally:
        release(branch.episode)
    for child in children:
        if child.episode.done:
            release(child.episode)
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
