"""The training loop: rollout → advantages → plan → replay → step → invalidate → log.

One update is one optimizer step over one update window. Each tree is one advantage group (one task's
rollouts); groups with zero reward variance are dropped before the manifest is built, so they never dilute
a denominator. The exactly-once window (`treetrain.distributed.window`) builds the manifest, replays,
retries what failed, and steps only when every contribution is counted once; then the model version
advances and every resident tensor of the old version becomes unreadable.

Example:
    >>> trainer = Trainer(load_config(None, ["updates=3", "run_dir=/tmp/run"]))     # doctest: +SKIP
    >>> summary = trainer.run()                                                       # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from envs.remote import WorkerEnvFactory
from treetrain.distributed.backend import TrainBackend, make_backend
from treetrain.distributed.window import UpdateWindow
from treetrain.distributed.window_types import Group, WindowConfig
from treetrain.engine import ReplayReport
from treetrain.engine.resident import ResidentIdentity, ResidentStore
from treetrain.io import atomic_write_text
from treetrain.loss.advantages import compute_advantages
from treetrain.memory.planner import Plan
from treetrain.memory.tracker import MemoryTracker
from treetrain.rollout.env_check import check_environment_config
from treetrain.stall import stall
from treetrain.train.config import TrainConfig, dump_config
from treetrain.train.metrics import MetricsWriter, UpdateMetrics, read_metrics
from treetrain.train.models import export_merged, load_models
from treetrain.train.planning import plan_for
from treetrain.train.progress import Progress
from treetrain.train.rundir import RunLock, claim_run_dir, remove_run_artifacts
from treetrain.train.summary import RunSummary, plot_rewards
from treetrain.train.trainer_state import TrainerState, resume_state, save_trainer_state
from treetrain.train.tree_sources import (
    RecordedSource,
    RolloutSource,
    check_context,
    check_first_prompt,
    check_template,
    config_context,
    task_seeds,
)
from treetrain.tree import TrajectoryTree
from treetrain.tree.stats import tree_stats

log = logging.getLogger(__name__)


def warn_config_changes(saved: Path, cfg: TrainConfig) -> None:
    """A resumed run should be the same run: say which settings differ from the saved config."""
    if not saved.is_file():
        return
    old = yaml.safe_load(saved.read_text()) or {}
    new = yaml.safe_load(dump_config(cfg))

    def flat(d: dict, prefix: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(old), flat(new)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k != "updates")
    if changed:
        log.warning("resuming with settings that differ from the saved run: %s", ", ".join(changed))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Runs `cfg.updates` updates in `cfg.run_dir`.

    `resume=True` continues from the latest checkpoint there. A fresh run refuses a directory that already
    holds a run unless `overwrite=True`, which removes the earlier run's artifacts first.
    """

    def __init__(
        self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True
    ) -> None:
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.progress = progress
        # One process (rank 0, known from the launcher before the backend exists) checks, marks and locks
        # the run directory before anything is loaded or written; a refusal ends every rank (torchrun).
        self.lock: RunLock | None = None
        if not cfg.rollout.trees:
            e = cfg.env  # before the run directory is touched
            check_environment_config(
                e.name, e.kwargs, e.rubric, task_seeds(cfg, 0)[0], cfg.rollout.step_timeout_s
            )
        if int(os.environ.get("RANK", "0")) == 0:
            self.lock = claim_run_dir(self.run_dir, resume=resume, overwrite=overwrite)
        try:
            self._setup(resume=resume, overwrite=overwrite)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run directory (the end of `run()` does; so does the end of the process)."""
        if getattr(self, "envs", None) is not None:
            self.envs.close()  # the environment worker process
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _setup(self, *, resume: bool, overwrite: bool) -> None:
        cfg = self.cfg
        seed_everything(cfg.seed)
        make = self.envs = WorkerEnvFactory(cfg.env.name, cfg.env.kwargs, cfg.rollout.step_timeout_s)
        recorded: list[RecordedSource] = []

        def read_trees(config: Any) -> None:  # before any model is built or sized from the config
            recorded.append(RecordedSource(cfg, int(config.vocab_size), config_context(config)))

        models = load_models(
            cfg.model,
            None if cfg.rollout.trees else lambda tok: check_template(cfg, tok, make),
            check_config=read_trees if cfg.rollout.trees else None,
        )
        check_context(cfg, models.policy)
        if not cfg.rollout.trees:
            check_first_prompt(cfg, models.tokenizer, models.policy, make)
        self.tokenizer = models.tokenizer
        self.reference = models.reference
        self.backend: TrainBackend = make_backend(models.policy, cfg.optim, cfg.distributed)
        self.state = TrainerState(update=0, version=0)
        self.identity = ResidentIdentity.of(self.backend.module, tokenizer=models.tokenizer_fingerprint)
        if resume:
            found = resume_state(self.backend, self.run_dir)
            if found is None:  # killed before its first checkpoint: the same run, from the start
                log.warning("--resume: %s has no checkpoint yet; starting from update 0", self.run_dir)
            else:
                self.state = found[0]
                self.identity = replace(self.identity, model_version=self.state.version)
        self.store = ResidentStore(self.identity)
        self.device = next(self.backend.module.parameters()).device
        self.last_plan: Plan | None = None
        self.source = recorded[0] if recorded else RolloutSource(cfg, self.tokenizer, make, self.backend)
        if not resume and overwrite and self.lock is not None:
            remove_run_artifacts(self.run_dir)
        if resume:
            warn_config_changes(self.run_dir / "config.yaml", cfg)
        if self.backend.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / "config.yaml", dump_config(cfg))
        self.metrics = (
            MetricsWriter(self.run_dir, truncate_after=self.state.update) if self.backend.rank == 0 else None
        )

    # ----- one update -------------------------------------------------------------------------------
    def _groups(self, produced: Sequence[tuple[TrajectoryTree, ...]]) -> tuple[list[Group], int]:
        """The update's advantage groups; zero-variance groups dropped when configured (never diluting)."""
        groups, dropped = [], 0
        for trees in produced:
            adv = compute_advantages(list(trees), self.cfg.advantages)
            if adv.zero_variance and self.cfg.advantages.zero_variance == "drop":
                dropped += 1
                continue
            groups.append(Group(tuple(trees), adv.trees))
        return groups, dropped

    def learning_rate(self, index: int) -> float:
        warm = self.cfg.lr_warmup_updates
        return self.cfg.optim.lr * (min(1.0, (index + 1) / warm) if warm else 1.0)

    def update(self, index: int) -> UpdateMetrics:
        cfg = self.cfg
        produced = self.source(self.backend.module, index, self.state.version)
        trees = produced.trees
        rewards = [r.reward for t in trees for r in t.records]
        groups, zero_var = self._groups(produced.groups)
        kept = [t for g in groups for t in g.trees]
        start = time.perf_counter()
        dropped, report, plan = 0, ReplayReport(), None
        balance: tuple[int, ...] = ()
        if groups:
            with self.backend.scratch():  # planning may calibrate with real backward passes
                plan = plan_for(
                    cfg,
                    kept,
                    [a for g in groups for a in g.advantages],
                    self.state.version,
                    self.backend.module,
                    self.reference,
                    self.backend.world_size,
                    zero_stage=self.backend.zero_stage,
                    offload_optimizer=self.backend.offload_optimizer,
                )
            self.last_plan = plan.plan
            every = cfg.measure_memory_every
            tracker = MemoryTracker(self.device) if every and index % every == 0 else None
            self.backend.set_learning_rate(self.learning_rate(index))
            window = UpdateWindow(
                self.backend,
                cfg.loss,
                plan.replay,
                WindowConfig(mode=plan.plan.mode, flat_microbatch=max(1, plan.plan.microbatch)),
                identity=self.identity,
                store=self.store,
                ref_model=self.reference,
                retention=plan.retention,
                keep_graph=plan.keep_graph,
                tracker=tracker,
            )
            result = window.run(groups)
            self.identity = window.identity
            dropped, report = len(result.dropped), result.local
            balance = result.rank_tokens
        else:
            log.warning("update %d: every group had zero reward variance; no optimizer step", index)
        train_seconds = time.perf_counter() - start
        self.state = TrainerState(update=index + 1, version=self.identity.model_version)
        flat_cost = sum(tree_stats(t).cost_flat(scoring=cfg.loss.ratio_source == "scoring") for t in kept)
        return UpdateMetrics(
            update=index,
            version=self.state.version,
            reward_mean=float(np.mean(rewards)) if rewards else 0.0,
            reward_std=float(np.std(rewards)) if rewards else 0.0,
            trajectories=len(rewards),
            groups=len(trees),
            groups_dropped=zero_var + dropped,
            loss=report.loss,
            pg=report.pg,
            kl=report.kl,
            entropy=report.entropy,
            clipped=report.clipped,
            mode=plan.mode if plan else "none",
            contract=cfg.replay.contract,
            failed_episodes=produced.failed_episodes,
            graph_tokens=report.graph_tokens,
            nograd_tokens=report.nograd_tokens,
            flat_token_cost=flat_cost // self.backend.world_size,
            token_cost=report.token_cost,
            rollout_seconds=produced.seconds,
            train_seconds=train_seconds,
            peak_bytes=report.measured_peak.dynamic if report.measured_peak else 0,
            predicted_peak_bytes=plan.predicted_dynamic_bytes if plan and report.measured_peak else 0,
            replay_tokens_max=max(balance, default=0),
            replay_tokens_mean=sum(balance) / len(balance) if balance else 0.0,
        )

    # ----- the run ----------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        cfg = self.cfg
        bar = tqdm(
            total=cfg.updates,
            initial=self.state.update,
            desc="train",
            disable=not self.progress or self.backend.rank != 0,
            dynamic_ncols=True,
        )
        shown = not bar.disable and self.state.update > 0
        progress = Progress.after(self.read_rows() if shown else [])
        last_saved = time.monotonic()
        try:
            try:
                for index in range(self.state.update, cfg.updates):
                    row = self.update(index)
                    if self.metrics is not None:
                        self.metrics.write(row)
                    stall("update-end", index)
                    bar.update(1)
                    bar.set_postfix(progress.fields(row), refresh=False)
                    if self._checkpoint_due(index, last_saved):
                        save_trainer_state(self.backend, self.run_dir, self.state)
                        last_saved = time.monotonic()
            finally:
                bar.close()
                if self.metrics is not None:
                    self.metrics.close()
            save_trainer_state(self.backend, self.run_dir, self.state)  # always at the end
            self.backend.export_pretrained(self.run_dir / "final", tokenizer=self.tokenizer)
            lora = cfg.model.lora
            if lora is not None and lora.export_merged and self.backend.rank == 0:
                export_merged(
                    cfg.model, self.run_dir / "final", self.run_dir / "final-merged", self.tokenizer
                )
            return self.finish()
        finally:
            self.close()

    def _checkpoint_due(self, index: int, last_saved: float) -> bool:
        """Checkpoint after update `index`: every `checkpoint_every` updates, or once `checkpoint_every_s`
        seconds have passed since the last one (rank 0's clock decides for every rank: saving is collective).
        The last update is always followed by a checkpoint anyway."""
        cfg = self.cfg
        if index + 1 >= cfg.updates:
            return False
        due = bool(cfg.checkpoint_every) and (index + 1) % cfg.checkpoint_every == 0
        if cfg.checkpoint_every_s > 0 and not due:
            late = time.monotonic() - last_saved >= cfg.checkpoint_every_s
            due = late if self.backend.world_size == 1 else self.backend.gather(str(int(late)))[0] == "1"
        return due

    def read_rows(self) -> list[UpdateMetrics]:
        return read_metrics(self.run_dir / "metrics.jsonl")

    def finish(self) -> RunSummary:
        rows = self.read_rows()
        summary = RunSummary.of(rows)
        if self.backend.rank == 0:
            plot_rewards(rows, self.run_dir / "reward.png")
            atomic_write_text(self.run_dir / "summary.txt", summary.text(rows) + "\n")
        return summary
