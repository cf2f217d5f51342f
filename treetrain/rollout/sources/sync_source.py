"""The synchronous source (`rollout.max_staleness = 0`): rollout and training take turns.

Each update's tasks grow at once on one engine, on the training thread, from the weights the last optimizer
step left; the engine is synced to them whenever the model version moved. This rank samples its share of
`task_seeds` (every W-th task) and the shares are exchanged (`treetrain.rollout.sources.shared_trees`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from treetrain.models.module_modes import evaluating
from treetrain.rollout.engines.factory import make_engine
from treetrain.rollout.engines.generation import EngineStats, GenerationEngine
from treetrain.rollout.engines.server_ranks import TrainerRanks
from treetrain.rollout.sources.engine_config import engine_spec, rollout_config, wrapper_config
from treetrain.rollout.sources.produced import Produced, lags_of
from treetrain.rollout.sources.run_settings import RunSettings, SourceInputs, task_seeds, update_dir
from treetrain.rollout.sources.shared_trees import gather_update
from treetrain.rollout.tree_rollout import rollout_trees


class RolloutSource:
    """Samples this rank's share of `groups_per_update` trees from the policy, then shares them.

    Every task of the update grows at once on one engine (`rollout.engine`), which is made on first use and
    synced to the trainer's weights whenever the model version moved (after every optimizer step). Trees are
    written under `<run_dir>/rollouts/update-XXXXX/` before training reads them.
    """

    waits_for: str | None = None
    """The trainer samples in `produce` itself: the progress bar counts its episodes."""
    one_sampler = False
    """Every rank samples its own share of the tasks."""

    def __init__(self, cfg: RunSettings, inputs: SourceInputs) -> None:
        self.cfg, self.inputs = cfg, inputs
        ranks = inputs.ranks
        self.wrapper = wrapper_config(cfg, ranks.module)
        spec = engine_spec(cfg, ranks.module, ranks.world_size, inputs.checkpoint)
        if ranks.world_size > 1:  # every rank samples its share; one leads the weight syncs of a shared fleet
            spec = replace(spec, ranks=TrainerRanks(ranks.rank, ranks.world_size, ranks.gather))
        self.spec = spec
        self.engine: GenerationEngine | None = make_engine(self.spec, ranks.module)
        """Made before the first update, so that a server that is down or a model vLLM cannot load stops the
        run before anything is sampled."""

    def _engine(self, model: Any, version: int) -> GenerationEngine:
        if self.engine is None:
            self.engine = make_engine(self.spec, model)
        if self.engine.version != version:
            with self.inputs.ranks.uneven():
                self.engine.sync_weights(model, version)
        return self.engine

    @contextlib.contextmanager
    def serving(self, model: Any, version: int) -> Iterator[GenerationEngine]:
        """The rollout engine serving `model`'s weights of `version` (held-out evaluation samples on it)."""
        yield self._engine(model, version)

    def trained(self, update: int, model: Any, version: int) -> None:
        """Update `update` stepped to `version`: the next rollout syncs the engine itself."""

    def produce(self, model: Any, update: int, version: int) -> Produced:
        start = time.perf_counter()
        ranks, cfg = self.inputs.ranks, self.cfg
        out_dir = update_dir(cfg, update)
        with evaluating(model):  # each module back in its own mode afterwards, not the wrapper's flag
            before = replace(self.engine.stats) if self.engine is not None else EngineStats()
            engine = self._engine(model, version)
            synced = engine.stats.since(before)
            config = replace(rollout_config(cfg, self.wrapper, version), on_episode=self.inputs.on_episode)
            with ranks.uneven():  # ranks generate different lengths (ZeRO-3: fetches rendezvous)
                result = rollout_trees(
                    model, self.inputs.tokenizer, self.inputs.make_env,
                    task_seeds(cfg, update)[ranks.rank :: ranks.world_size], out_dir, config,
                    env_name=cfg.env.name, engine=engine,
                )  # fmt: skip
        result = replace(result, stats=result.stats.with_syncs(synced))
        self.stats = result.stats
        produced = gather_update(cfg, ranks, update, result, time.perf_counter() - start)
        return replace(produced, staleness=lags_of(produced.trees, version), trainer_idle=produced.seconds)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
