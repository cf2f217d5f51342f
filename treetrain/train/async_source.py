"""Rollout beside training: a sampler thread grows the next updates' trees while the current update trains.

With `rollout.max_staleness = K >= 1` (docs/async-training.md) the trainer and the sampler no longer take
turns. The sampler thread owns the inference engine and grows update u's trees as soon as the **pacing
rule** allows: the trainer has finished update u - K - 1, so its weights are at most K steps newer than
any the sampler can hold while update u is sampled. The trainer, after each optimizer step, only publishes
its weights (`treetrain.rollout.weight_feed.WeightFeed.publish`); the sampler takes them between its own
engine steps, interrupting the requests in flight, so a turn in flight goes on under the newer weights
from its next token, and every token records the version that sampled it. When update u takes its trees, `treetrain.train.staleness.split_stale`
checks every token's lag against K once more; what breaks the bound (only ever trees kept from before a
resume that lowered K) is dropped and counted. In steady state nothing is dropped: admission is paced.

Everything that is collective stays on the training thread: the trees of all ranks are shared, failures
written and counted, and weights gathered when the update takes them (`gather_update`). The `hf` engine runs
in a process of its own (`treetrain.rollout.engines.hf_process`), so sampling and training do not share the
interpreter lock; it samples from a private copy of the policy, which it copies from the published weights
(the shadow, in shared memory) at each sync, never from the model being trained.

**Exactly once.** Each update's tasks are a function of the update index (`task_seeds`), so a trajectory
belongs to one update only. A finished rollout is queued on disk: its trees are in
`rollouts/update-XXXXX/trees/` and `queued-rank<r>.json` there lists them, written atomically after the last tree.
A resumed run takes a queued update's trees from disk if its rollout had no failed task and no token from
weights newer than the resumed trainer's (a run killed between checkpoints had moved on); any other update
is sampled again from its task seeds. A checkpoint says which updates were trained, so none is trained twice
and none is lost.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from envs.protocol import Environment
from treetrain.distributed.backend import OnPoint, TrainBackend
from treetrain.io import atomic_write_text
from treetrain.rollout.engines.factory import make_engine
from treetrain.rollout.engines.generation import EngineStats, GenerationEngine
from treetrain.rollout.engines.sampler_process import SamplerProcess
from treetrain.rollout.tree_rollout import RolloutResult, rollout_trees
from treetrain.rollout.weight_feed import SamplerStopped, WeightFeed
from treetrain.runfs import UnsafePathError, read_bytes, remove_file
from treetrain.train.config import TrainConfig
from treetrain.train.staleness import split_stale
from treetrain.train.tree_sources import (
    Produced,
    engine_spec,
    gather_update,
    lags_of,
    rollout_config,
    task_seeds,
    update_dir,
    wrapper_config,
)
from treetrain.tree import TrajectoryTree
from treetrain.tree.format import load_trees

log = logging.getLogger(__name__)


def queued_marker(out_dir: Path, rank: int) -> Path:
    """The marker of rank `rank`'s finished rollout waiting for its update: the names of its tree files."""
    return out_dir / f"queued-rank{rank}.json"


MAX_MARKER_BYTES = 1 << 20
"""Largest marker read back (a name per tree of one rank's update: far below this)."""


@dataclass(frozen=True)
class Queued:
    """A finished rollout as its marker lists it: the tree files, their trees, the steps that timed out."""

    paths: tuple[Path, ...]
    trees: tuple[TrajectoryTree, ...]
    step_timeouts: int


def read_queued(run_dir: str | Path, update: int, rank: int = 0) -> Queued:
    """Rank `rank`'s queued rollout of `update` in `run_dir` (an `OSError` or `ValueError` when missing or
    unreadable): the trees a resumed run takes, and what tests and benchmarks check token by token."""
    out_dir = Path(run_dir) / "rollouts" / f"update-{update:05d}"
    raw = read_bytes(run_dir, queued_marker(out_dir, rank), MAX_MARKER_BYTES)  # never through a link
    if len(raw) > MAX_MARKER_BYTES:
        raise ValueError(f"{queued_marker(out_dir, rank)}: over {MAX_MARKER_BYTES} bytes")
    listed = json.loads(raw)
    if not isinstance(listed, dict) or not isinstance(listed.get("trees"), list):
        raise ValueError(f"{queued_marker(out_dir, rank)}: not a list of tree files")
    paths = tuple(out_dir / "trees" / Path(str(name)).name for name in listed["trees"])
    return Queued(paths, tuple(t for p in paths for t in load_trees(p)), int(listed.get("step_timeouts", 0)))


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

    `start` is the first update to train. The first call publishes the trainer's weights and starts the
    sampler thread; each call takes one update's trees (waiting for them if need be), and `trained` after
    each step publishes the new weights and lets the sampler on.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        tokenizer: Any,
        make_env: Callable[[], Environment],
        backend: TrainBackend,
        start: int,
        on_point: OnPoint | None = None,
        sampler: SamplerProcess | None = None,
    ) -> None:
        """`on_point` is called on the sampler thread as an update's rollout starts (`"rollout-start"`) and
        once it is queued (`"rollout-queued"`): the interruption tests' seam. `sampler` is the `hf` engine's
        process if it was spawned earlier (`treetrain.train.sampler_start`), which the engine adopts."""
        self.on_point = on_point
        self.cfg, self.backend, self.tokenizer, self.make_env = cfg, backend, tokenizer, make_env
        self.max_staleness = cfg.rollout.max_staleness
        self.pace = self.max_staleness
        """How many updates ahead of the trainer the sampler may start one (K; the negative-control tests
        run it further ahead, and the check of every token's lag catches it)."""
        self.wrapper = wrapper_config(cfg, backend.module)
        if cfg.loss.sampler_correction == "none" and cfg.loss.ratio_source == "scoring":
            log.warning(
                "rollout.max_staleness=%d with loss.sampler_correction='none': stale tokens train without a "
                "correction for the sampler (decoupled PPO is sampler_correction='token_truncate')",
                self.max_staleness,
            )
        model = backend.module
        own_process = cfg.rollout.engine == "hf"  # the sampler process copies the shared shadow at each sync
        self.feed = WeightFeed(model, version=0, shared=own_process)
        spec = engine_spec(cfg, model, backend.world_size)  # K >= 1: weights change in flight
        self.engine: GenerationEngine = make_engine(spec, self.feed.sampling_model, process=sampler)
        self._serving = threading.Lock()  # held while the sampler grows an update, or evaluation samples
        self._cond = threading.Condition()
        self._trained = start
        self._ready: dict[int, Sampled] = {}
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._start = start

    def begin(self, version: int) -> None:
        """Publish the starting weights (`version`) and start the sampler thread."""
        self.feed.publish(self.backend.module, version)
        self._thread = threading.Thread(target=self._run, name="treetrain-sampler", daemon=True)
        self._thread.start()

    # ----- the training thread ----------------------------------------------------------------------
    def __call__(self, model: Any, update: int, version: int) -> Produced:
        if self._thread is None:
            self.begin(version)
        waited = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: update in self._ready or self._failed is not None)
            if self._failed is not None and update not in self._ready:
                raise self._failed
            sampled = self._ready.pop(update)
            depth = len(self._ready)
        idle = time.perf_counter() - waited
        produced = gather_update(self.cfg, self.backend, update, sampled.result, sampled.seconds)
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
            sampler_idle=sampled.idle, trainer_idle=idle,
        )  # fmt: skip

    def trained(self, update: int, model: Any, version: int) -> None:
        """Update `update` is done and the trainer is at `version`: publish the weights, let the sampler on."""
        if version != self.feed.version:
            self.feed.publish(model, version)
        with self._cond:
            self._trained = update + 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def serving(self, model: Any, version: int) -> Iterator[GenerationEngine]:
        """The engine at the trainer's published weights, between two of the sampler's updates (held-out
        evaluation samples on it while the sampler waits)."""
        with self._serving:
            if self.feed.due(self.engine.version):
                self.feed.sync(self.engine)
            yield self.engine

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
        out_dir = update_dir(self.cfg, update)
        if self.on_point is not None:
            self.on_point("rollout-start", update)
        if self.feed.due(self.engine.version):
            self.feed.sync(self.engine)
        result = rollout_trees(
            self.feed.sampling_model, self.tokenizer, self.make_env, task_seeds(self.cfg, update)[rank::world],
            out_dir, rollout_config(self.cfg, self.wrapper, None), env_name=self.cfg.env.name,
            engine=self.engine, weights=self.feed,
        )  # fmt: skip
        if not result.failures:
            names = [p.name for p in result.paths]
            listed = json.dumps({"trees": names, "step_timeouts": result.step_timeouts})
            atomic_write_text(queued_marker(out_dir, rank), listed)
            if self.on_point is not None:
                self.on_point("rollout-queued", update)
        return Sampled(result, time.perf_counter() - start, idle)

    def _queued(self, update: int) -> Sampled | None:
        """The trees a killed run left queued for `update`, when they may still be trained (see the module
        docstring); None to sample the update again."""
        marker = queued_marker(update_dir(self.cfg, update), self.backend.rank)
        if not os.path.lexists(marker):
            return None
        try:
            queued = read_queued(self.cfg.run_dir, update, self.backend.rank)
        except (OSError, ValueError, UnsafePathError) as exc:
            log.warning("update %d: the queued rollout cannot be read (%s); sampling it again", update, exc)
            return None
        trees = queued.trees
        newest = max((v for t in trees for vs in t.node_versions for v in vs), default=0)
        if newest > self.feed.version:
            log.warning(
                "update %d: the queued rollout holds tokens of version %d, newer than the resumed trainer's "
                "%d; sampling it again", update, newest, self.feed.version,
            )  # fmt: skip
            remove_file(self.cfg.run_dir, marker)
            return None
        log.info("update %d: taking its %d queued trees from %s", update, len(trees), marker.parent)
        return Sampled(RolloutResult(trees, queued.paths, EngineStats(), (), queued.step_timeouts), 0.0, 0.0)
