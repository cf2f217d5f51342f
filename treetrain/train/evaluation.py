"""Held-out evaluation: pass@1, pass@k and the mean reward of the policy on tasks training never draws.

The tasks come from `treetrain.train.held_out`. Sampling goes through the training rollout, `rollout_trees`,
on the run's engine: each task is one tree whose root fans out `eval.samples` ways and never branches again,
so every trajectory is one independent sample of the task.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.protocol import Environment
from envs.wrapper import WrapperConfig
from treetrain.models.module_modes import evaluating
from treetrain.rollout.engines.generation import GenerationEngine
from treetrain.rollout.fanout import FanOut
from treetrain.rollout.prefix_sampler import SamplerConfig
from treetrain.rollout.sampling import Sampling
from treetrain.rollout.tree_rollout import RolloutConfig, rollout_trees
from treetrain.train.config import TrainConfig
from treetrain.train.held_out import HeldOut, pass_at_k
from treetrain.train.metrics import EvalMetrics


@dataclass(frozen=True)
class Scores:
    """Per-task rewards of one evaluation, in task order, and how many tasks failed."""

    rewards: tuple[tuple[float, ...], ...]
    failed_tasks: int

    def metrics(
        self, update: int, version: int, threshold: float, seconds: float, greedy: bool
    ) -> EvalMetrics:
        scored = [r for r in self.rewards if r]
        n = min((len(r) for r in scored), default=1)
        flat = [x for r in scored for x in r]
        passes = [sum(x >= threshold for x in r) for r in scored]
        return EvalMetrics(
            update=update, version=version, tasks=len(scored), samples=n,
            pass_at_1=sum(pass_at_k(len(r), c, 1) for r, c in zip(scored, passes)) / len(scored) if scored else 0.0,
            pass_at_k=sum(pass_at_k(len(r), c, n) for r, c in zip(scored, passes)) / len(scored) if scored else 0.0,
            reward_mean=sum(flat) / len(flat) if flat else 0.0, failed_tasks=self.failed_tasks,
            seconds=seconds, greedy=greedy,
        )  # fmt: skip


def eval_rollout(cfg: TrainConfig, wrapper: WrapperConfig, version: int = 0) -> RolloutConfig:
    """The rollout of a held-out evaluation: each task's root fanned out `eval.samples` ways and nothing
    more, greedy or at the training temperature (`eval.greedy`), on the run's episode limits and rubric."""
    samples = cfg.eval.samples
    return RolloutConfig(
        fanout=FanOut(root=samples, max_depth=1, max_trajectories=samples),
        sampler=SamplerConfig(eval_sampling(cfg), seed=cfg.seed), wrapper=wrapper, rubric=cfg.env.rubric,
        model_version=version, max_concurrent_steps=cfg.rollout.max_concurrent_steps,
    )  # fmt: skip


def sample_scores(
    model: Any,
    tokenizer: Any,
    make_env: Callable[[], Environment],
    seeds: Sequence[int],
    out_dir: Path,
    *,
    engine: GenerationEngine | None,
    config: RolloutConfig,
    env_name: str,
) -> Scores:
    """Sample each task as `config` says (`eval_rollout`) through `rollout_trees`; their rewards."""
    result = rollout_trees(
        model, tokenizer, make_env, seeds, out_dir, config, env_name=env_name, engine=engine
    )
    rewards = tuple(tuple(r.reward for r in tree.records) for tree in result.trees)
    return Scores(rewards, len(result.failures))


def gather_scores(gather: Callable[[str], list[str]], local: Scores) -> Scores:
    """Every rank's scores together, from one `gather` of JSON (a collective: every rank calls it)."""
    parts = [json.loads(p) for p in gather(json.dumps({"r": local.rewards, "f": local.failed_tasks}))]
    if len(parts) == 1:
        return local
    rewards = tuple(tuple(float(x) for x in task) for p in parts for task in p["r"])
    return Scores(rewards, sum(int(p["f"]) for p in parts))


def eval_sampling(cfg: TrainConfig) -> Sampling:
    """Greedy decoding, or the rollout's own sampling settings."""
    return Sampling(temperature=0.0) if cfg.eval.greedy else cfg.rollout.sampling


class Evaluator:
    """The held-out evaluation of a training run (`eval.every`), sampled on the run's rollout engine.

    Each rank samples every W-th held-out task; the rewards are gathered, so every rank returns the same
    row. Trees are kept under `<run_dir>/eval/update-XXXXX/trees/`."""

    def __init__(
        self, cfg: TrainConfig, held: HeldOut, tokenizer: Any, wrapper: WrapperConfig, backend: Any
    ) -> None:
        from envs.remote import WorkerEnvFactory

        self.cfg, self.held, self.tokenizer, self.wrapper, self.backend = (
            cfg,
            held,
            tokenizer,
            wrapper,
            backend,
        )
        self.factory = WorkerEnvFactory(
            cfg.env.name, held.kwargs, cfg.rollout.episode.step_timeout_s,
            max_concurrent=cfg.rollout.max_concurrent_steps,
        )  # fmt: skip

    def due(self, completed: int) -> bool:
        """Whether to evaluate once `completed` updates are done: before the first, every `eval.every`-th,
        and after the last."""
        every = self.cfg.eval.every
        return bool(every) and (completed % every == 0 or completed == self.cfg.updates)

    def __call__(
        self,
        model: Any,
        engine: GenerationEngine | None,
        update: int,
        version: int,
        one_sampler: bool = False,
    ) -> EvalMetrics:
        """Sample this rank's share of the held-out tasks on `engine` and gather every rank's scores;
        `one_sampler`: rank 0 samples every task (the run's `TreeSource.one_sampler`)."""
        from treetrain.runfs import make_dirs

        cfg, rank, world = self.cfg, self.backend.rank, self.backend.world_size
        seeds = self.held.seeds[rank::world] if not one_sampler else self.held.seeds if rank == 0 else ()
        out_dir = Path(cfg.run_dir) / "eval" / f"update-{update:05d}"
        make_dirs(cfg.run_dir, out_dir / "trees")
        start = time.perf_counter()
        with evaluating(model), self.backend.uneven():  # each module back in its own mode afterwards
            local = Scores((), 0)
            if seeds:  # leaving `uneven` is a collective: a rank with no share enters it all the same
                local = sample_scores(
                    model, self.tokenizer, self.factory, seeds, out_dir, engine=engine,
                    config=eval_rollout(cfg, self.wrapper, version), env_name=cfg.env.name,
                )  # fmt: skip
        scores = gather_scores(self.backend.gather, local)
        return scores.metrics(
            update, version, cfg.eval.pass_threshold, time.perf_counter() - start, cfg.eval.greedy
        )

    def close(self) -> None:
        self.factory.close()
