"""Rollout beside training: a sampler thread grows the next updates' trees while the current update trains.

With `rollout.max_staleness = K >= 1` (docs/async-training.md) the trainer and the sampler no longer take
turns. The sampler thread owns the inference engine and grows update u's trees as soon as the **pacing
rule** allows: the trainer has finished update u - K - 1, so its weights are at most K steps newer than
any the sampler can hold while update u is sampled. The trainer, after each optimizer step, only publishes
its weights (`treetrain.rollout.weight_feed.WeightFeed.publish`); the sampler takes them between its own
engine steps, interrupting the requests in flight, so a turn in flight goes on under the newer weights
from its next token, and every token records the version that sampled it. When update u takes its trees,
`treetrain.rollout.sources.staleness.split_stale` checks every token's lag against K once more; what breaks
the bound (only ever trees kept from before a resume that lowered K) is dropped and counted. In steady state nothing is dropped: admission is paced.

Everything that is collective stays on the training thread: the trees of all ranks are shared, failures
written and counted, and weights gathered when the update takes them (`gather_update`).

**Where the weights go.** On `vllm` and `hf` every rank samples its share of the tasks from a shadow of its
own (`WeightFeed`), which ZeRO-3 could not hold: under ZeRO-3 the `hf` engine samples on rank 0 alone, from
one shadow that every rank's gathers fill module by module (`treetrain.rollout.gathered_feed`), and `vllm`
is refused. On `vllm-server` the servers hold the weights: every rank
publishes each version on the training thread (`treetrain.rollout.served_feed.ServedFeed`: the gathers run on
every rank and rank 0 writes the files), and rank 0's sampler thread alone is the fleet's client. It samples
every task of the update and has the servers load each published version between its engine steps, and the
trees reach the other ranks through the update's gather. So an asynchronous run on servers takes any number
of ranks under any ZeRO stage, and no rank ever holds the whole model. The `hf` engine runs
in a process of its own (`treetrain.rollout.engines.hf_process`), so sampling and training do not share the
interpreter lock; it samples from a private copy of the policy, which it copies from the published weights
(the shadow, in shared memory) at each sync, never from the model being trained.

**Exactly once.** Each update's tasks are a function of the update index (`task_seeds`), so a trajectory
belongs to one update only. A finished rollout is queued on disk before the trainer may take it, and a
resumed run takes what was queued and samples the rest again (`treetrain.rollout.sources.tree_queue`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from treetrain.rollout.engines.factory import make_engine
from treetrain.rollout.engines.generation import EngineStats, GenerationEngine
from treetrain.rollout.engines.server_sync import served_adapters
from treetrain.rollout.engines.weight_buckets import partitioned
from treetrain.rollout.gathered_feed import GatheredFeed
from treetrain.rollout.served_feed import ServedFeed
from treetrain.rollout.sources.engine_config import engine_spec, rollout_config, wrapper_config
from treetrain.rollout.sources.produced import Produced, lags_of
from treetrain.rollout.sources.run_settings import RunSettings, SourceInputs, task_seeds, update_dir
from treetrain.rollout.sources.shared_trees import gather_update
from treetrain.rollout.sources.staleness import split_stale
from treetrain.rollout.sources.tree_queue import take_queued, write_queued
from treetrain.rollout.tree_rollout import RolloutResult, rollout_trees
from treetrain.rollout.weight_feed import SamplerStopped, WeightFeed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampled:
    """One update's rollout on this rank, as the sampler left it for the trainer."""

    result: RolloutResult
    seconds: float
    """Wall time of growing it (0 when taken from the queue on disk)."""
    idle: float
    """Seconds the sampler waited for the pacing rule before starting it."""


class AsyncRolloutSource:
    """The trees of each update, grown ahead by a sampler thread; see the module docstring.

    `inputs.start` is the first update to train. The first `produce` publishes the trainer's weights and starts the
    sampler thread; each call takes one update's trees (waiting for them if need be), and `trained` after
    each step publishes the new weights and lets the sampler on.
    """

    waits_for: str | None = "waiting for rollouts"
    """The sampler thread grows the trees: the trainer only waits for them."""

    def __init__(self, cfg: RunSettings, inputs: SourceInputs) -> None:
        """`inputs.start` is the first update to train, `inputs.on_point` the interruption tests' seam, and
        `inputs.sampler` the `hf` engine's process if it was started early, which the engine adopts."""
        self.on_point = inputs.on_point
        self.cfg, self.inputs, self.backend = cfg, inputs, inputs.ranks
        self.max_staleness = cfg.rollout.max_staleness
        self.pace = self.max_staleness
        """How many updates ahead of the trainer the sampler may start one (K; the negative-control tests
        run it further ahead, and the check of every token's lag catches it)."""
        self.wrapper = wrapper_config(cfg, self.backend.module)
        if cfg.loss.sampler_correction == "none" and cfg.loss.ratio_source == "scoring":
            log.warning(
                "rollout.max_staleness=%d with loss.sampler_correction='none': stale tokens train without a "
                "correction for the sampler (decoupled PPO is sampler_correction='token_truncate')",
                self.max_staleness,
            )
        model = self.backend.module
        sharded = partitioned(model)
        spec = engine_spec(  # weights change in flight; ZeRO-3's shadow samples on the CPU
            cfg, model, self.backend.world_size, inputs.checkpoint, "cpu" if sharded else None
        )
        if sharded:
            cfg.rollout.check_sharded_weights()  # a DeepSpeed JSON may ask for ZeRO-3 where the config did not
        self.one_sampler = cfg.rollout.engine == "vllm-server" or sharded
        """Whether rank 0's sampler samples every task (from a shared fleet, or from the one shadow ZeRO-3
        affords) and the other ranks sample none."""
        self.samples = not self.one_sampler or self.backend.rank == 0
        """Whether this rank has a sampler thread and an engine."""
        self.feed: WeightFeed | ServedFeed
        if cfg.rollout.engine == "vllm-server":
            from treetrain.rollout.engines.adapter_sync import lora_serving

            weights_dir = Path(cfg.run_dir) / "engine-weights"
            adapters = served_adapters(weights_dir, lora_serving(model))
            self.feed = ServedFeed(weights_dir, adapters, version=0, writes=self.samples)
        elif sharded:  # rank 0's `hf` process copies the shadow that every rank's gathers fill
            self.feed = GatheredFeed(model, version=0, holds=self.samples)
        else:  # an `hf` sampler process copies the shared shadow at each sync
            self.feed = WeightFeed(model, version=0, shared=cfg.rollout.engine == "hf")
        self.engine: GenerationEngine | None = None
        if self.samples:
            sampling = self.feed.sampling_model
            self.engine = make_engine(spec, model if sampling is None else sampling, process=inputs.sampler)
        elif inputs.sampler is not None:
            inputs.sampler.close()
        self._serving = threading.Lock()  # held while the sampler grows an update, or evaluation samples
        self._cond = threading.Condition()
        self._trained = inputs.start
        self._ready: dict[int, Sampled] = {}
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._begun = False
        self._publish_seconds = 0.0
        """How long the last publish took (after the previous step)."""
        self._start = inputs.start

    def begin(self, version: int) -> None:
        """Publish the starting weights (`version`) and start the sampler thread."""
        self.feed.publish(self.backend.module, version)
        self._begun = True
        if self.samples:
            self._thread = threading.Thread(target=self._run, name="treetrain-sampler", daemon=True)
            self._thread.start()

    # ----- the training thread ----------------------------------------------------------------------
    def produce(self, model: Any, update: int, version: int) -> Produced:
        if not self._begun:
            self.begin(version)
        waited = time.perf_counter()
        sampled, depth = self._take(update)
        idle = time.perf_counter() - waited
        produced = gather_update(
            self.cfg, self.backend, update, sampled.result, sampled.seconds, led=self.one_sampler
        )
        groups, stale = split_stale(produced.groups, version, self.max_staleness)
        if stale.groups:
            log.warning(
                "update %d: %d groups (%d policy tokens) dropped: sampled more than rollout.max_staleness=%d "
                "versions before the trainer's version %d", update, stale.groups, stale.tokens,
                self.max_staleness, version,
            )  # fmt: skip
        trees = tuple(t for g in groups for t in g)
        return replace(
            produced, groups=groups, staleness=lags_of(trees, version), stale=stale, queue_depth=depth,
            sampler_idle=sampled.idle, trainer_idle=idle, weight_publish_seconds=self._publish_seconds,
        )  # fmt: skip

    def _take(self, update: int) -> tuple[Sampled, int]:
        """This rank's rollout of `update` (waiting for the sampler), and how many later ones wait; a rank
        with no sampler has none (rank 0's trees reach it in the gather)."""
        if not self.samples:
            return Sampled(RolloutResult((), (), EngineStats(), ()), 0.0, 0.0), 0
        with self._cond:
            self._cond.wait_for(lambda: update in self._ready or self._failed is not None)
            if self._failed is not None and update not in self._ready:
                raise self._failed
            sampled = self._ready.pop(update)
            return sampled, len(self._ready)

    def trained(self, update: int, model: Any, version: int) -> None:
        """Update `update` is done and the trainer is at `version`: publish the weights, let the sampler on."""
        start = time.perf_counter()
        if version != self.feed.version:  # an update that took no step publishes nothing
            self.feed.publish(model, version)
        self._publish_seconds = time.perf_counter() - start
        with self._cond:
            self._trained = update + 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def serving(self, model: Any, version: int) -> Iterator[GenerationEngine]:
        """The engine at the trainer's published weights, between two of the sampler's updates (held-out
        evaluation samples on it while the sampler waits)."""
        if not self._begun:  # an evaluation before the first update: the weights are published first
            self.begin(version)
        with self._serving:
            if self.engine is not None and self.feed.due(self.engine.version):
                self.feed.sync(self.engine)
            yield self.engine  # type: ignore[misc]  # None on a rank with no sampler, which samples nothing

    def close(self) -> None:
        """Stop the sampler at its next safe point and free the engine."""
        self.feed.close()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            if self._thread.is_alive():  # a tool call that does not return: the daemon thread ends with us
                log.warning("the sampler thread is still in a rollout step after 60 s; leaving it")
                return
        with self._serving:
            if self.engine is not None:
                self.engine.close()

    # ----- the sampler thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for update in range(self._start, self.cfg.updates):
                waited = time.perf_counter()
                with self._cond:  # the pacing rule: sampled by a version of at least the trainer's - K
                    self._cond.wait_for(functools.partial(self._admitted, update))
                if self.feed.closed:
                    return
                idle = time.perf_counter() - waited
                with self._serving:
                    sampled = self._queued(update) or self._grow(update, idle)
                with self._cond:
                    self._ready[update] = sampled
                    self._cond.notify_all()
        except SamplerStopped:
            return
        except BaseException as exc:  # the trainer raises it when it next takes trees
            with self._cond:
                self._failed = exc
                self._cond.notify_all()

    def _admitted(self, update: int) -> bool:
        """The pacing rule: `update` may be sampled once the trainer finished update `update - K - 1`."""
        return self.feed.closed or self._trained >= update - self.pace

    def _grow(self, update: int, idle: float) -> Sampled:
        start = time.perf_counter()
        rank, world = self.backend.rank, self.backend.world_size
        assert self.engine is not None
        out_dir = update_dir(self.cfg, update)
        if self.on_point is not None:
            self.on_point("rollout-start", update)
        before = replace(self.engine.stats)
        if self.feed.due(self.engine.version):
            self.feed.sync(self.engine)
        synced = self.engine.stats.since(before)
        seeds = task_seeds(self.cfg, update)
        if not self.one_sampler:
            seeds = seeds[rank::world]
        result = rollout_trees(
            self.feed.sampling_model, self.inputs.tokenizer, self.inputs.make_env, seeds, out_dir,
            rollout_config(self.cfg, self.wrapper, None), env_name=self.cfg.env.name, engine=self.engine,
            weights=self.feed,
        )  # fmt: skip
        result = replace(result, stats=result.stats.with_syncs(synced))
        if not result.failures:
            write_queued(out_dir, rank, result.paths, result.step_timeouts)
            if self.on_point is not None:
                self.on_point("rollout-queued", update)
        return Sampled(result, time.perf_counter() - start, idle)

    def _queued(self, update: int) -> Sampled | None:
        """The trees a killed run left queued for `update`, when they may still be trained; None to sample
        the update again (`treetrain.rollout.sources.tree_queue.take_queued`)."""
        out_dir = update_dir(self.cfg, update)
        result = take_queued(self.cfg.run_dir, out_dir, update, self.backend.rank, self.feed.version)
        return None if result is None else Sampled(result, 0.0, 0.0)
