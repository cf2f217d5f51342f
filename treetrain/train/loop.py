"""The training loop: rollout → advantages → plan → replay → step → invalidate → log.

One update is one optimizer step over one update window. Each tree is one advantage group (one task's
rollouts); groups with zero reward variance are dropped before the manifest is built, so they never dilute
a denominator. The update itself (`treetrain.update.run.run_update`) builds the manifest, plans, replays,
retries what failed, and steps only when every contribution is counted once; then the model version
advances and every resident tensor of the old version becomes unreadable.

Example:
    >>> trainer = Trainer(load_config(None, ["updates=3", "run_dir=/tmp/run"]))     # doctest: +SKIP
    >>> summary = trainer.run()                                                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from envs.remote import WorkerEnvFactory
from treetrain.distributed.backend import OnPoint, TrainBackend
from treetrain.distributed.backend_choice import make_backend
from treetrain.io import atomic_write_text
from treetrain.memory.planner import Plan
from treetrain.memory.tracker import MemoryTracker
from treetrain.replay.resident import ResidentIdentity, ResidentStore
from treetrain.rollout.sources.engine_config import config_context, engine_loggers, wrapper_config
from treetrain.rollout.sources.env_failures import EnvironmentFailedError
from treetrain.rollout.sources.recorded_source import RecordedSource
from treetrain.rollout.sources.run_settings import SourceInputs, task_seeds
from treetrain.rollout.sources.sampler_start import SamplerProcess, early_sampler
from treetrain.rollout.sources.tree_source import TreeSource, open_source
from treetrain.runfs import UnsafePathError
from treetrain.train.advice import no_signal_advice
from treetrain.train.config import TrainConfig, dump_config
from treetrain.train.device import place, train_device
from treetrain.train.evaluation import Evaluator
from treetrain.train.held_out import HeldOut
from treetrain.train.metrics import MetricsWriter, UpdateMetrics, read_evals, read_metrics
from treetrain.train.models import export_merged, load_models, resolve_model_path
from treetrain.train.preflight import Preflight, check_context, check_first_prompt, check_template, preflight
from treetrain.train.progress import Phases, Progress, eval_line
from treetrain.train.resume import SAVED_CONFIG
from treetrain.train.rundir import RunLock, abandon_run_dir, remove_run_artifacts
from treetrain.train.summary import RunSummary, plot_rewards
from treetrain.train.trainer_state import TrainerState, resume_state, save_trainer_state
from treetrain.train.typed import to_dict
from treetrain.update.learner import Learner
from treetrain.update.run import run_update

log = logging.getLogger(__name__)


def _console_loggers() -> list[logging.Logger]:
    """The loggers whose console handlers would write across the bar: the root's (treetrain's, the
    environments') and the inference libraries' that have handlers of their own."""
    return [logging.getLogger(), *engine_loggers()]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Runs `cfg.updates` updates in `cfg.run_dir`.

    `resume=True` continues from the latest checkpoint there, and `cfg` must be the run's saved settings
    changed only where `treetrain.train.resume.RESUMABLE` allows. A fresh run refuses a directory that
    already holds a run unless `overwrite=True`, which removes the earlier run's artifacts first. A fresh run
    in a new or empty directory that fails before its first update completes removes what it wrote, and the
    error carries a note saying so.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        resume: bool = False,
        overwrite: bool = False,
        progress: bool = True,
        on_point: OnPoint | None = None,
        checked: Preflight | None = None,
        sampler: SamplerProcess | None = None,
    ) -> None:
        """`on_point`, if given, is called once an update has taken its trees (`"update-start"`), after each
        update's metrics row (`"update-end"`), inside each checkpoint write of the torch backend
        (`"checkpoint-write"`) and, with `rollout.max_staleness` >= 1, on the sampler thread as a rollout
        starts and once it is queued (`"rollout-start"`, `"rollout-queued"`): the interruption tests' seam.
        `checked` is what `preflight(cfg, resume=resume, overwrite=overwrite)` returned, when the caller ran
        those checks before loading torch (the command line does); without it they run here.

        `sampler`: the rollout's sampler process, started before this (`early_sampler`); when the run needs
        one and none is given, it is started here once the checks pass, before the model loads."""
        self.on_point = on_point
        self.phases: Phases | None = None
        """What the progress bar says the update is doing (set by `run`)."""
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.progress = progress
        # The environment, the held-out tasks and the servers are checked, and the run directory is marked
        # and locked by one process (rank 0), before anything is loaded; a refusal ends every rank (torchrun).
        checked = checked or preflight(cfg, resume=resume, overwrite=overwrite)
        self.sampler = sampler if sampler is not None else early_sampler(cfg)
        self.held: HeldOut | None = checked.held
        self.lock: RunLock | None = checked.lock
        try:
            self._setup(resume=resume, overwrite=overwrite)
        except BaseException as exc:
            self.abandon_unstarted(exc)
            self.close()
            raise

    def close(self) -> None:
        """Release the run directory (the end of `run()` does; so does the end of the process)."""
        source: TreeSource | None = getattr(self, "source", None)
        if source is not None:
            source.close()  # the inference engine (and the sampler thread), if any
        evaluator = getattr(self, "evaluator", None)
        if evaluator is not None:
            evaluator.close()  # its environment workers
        if getattr(self, "envs", None) is not None:
            self.envs.close()  # the environment worker process
        if self.sampler is not None:
            self.sampler.close()  # one no engine took (a no-op once the engine owns it)
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def abandon_unstarted(self, exc: BaseException, completed: int = 0) -> None:
        """A fresh run in a new or empty directory that ends with `completed == 0` updates removes what it
        wrote (`abandon_run_dir`) and notes on `exc` what is left, so the refusal says it in its one line.
        A run stopped by its environment keeps only `env-errors/`: the refusal names the traceback file there,
        and the next run in the directory needs no `--overwrite`."""
        if self.lock is None or not self.lock.fresh or completed:
            return
        keep = isinstance(exc, EnvironmentFailedError)
        try:
            exc.add_note(abandon_run_dir(self.run_dir, self.lock, keep_env_errors=keep))
        except (OSError, UnsafePathError) as problem:
            exc.add_note(f"the run never started, and cleaning up {self.run_dir} failed: {problem}")

    def _setup(self, *, resume: bool, overwrite: bool) -> None:
        cfg = self.cfg
        seed_everything(cfg.seed)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        tasks = -(-cfg.rollout.groups_per_update // world)  # this rank's tasks per update
        make = self.envs = WorkerEnvFactory(
            cfg.env.name, cfg.env.kwargs, cfg.rollout.episode.step_timeout_s,
            max_concurrent=cfg.rollout.max_concurrent_steps, workers=cfg.rollout.env_workers or min(tasks, 16),
            rubric_timeout=cfg.rollout.rubric_timeout_s,
        )  # fmt: skip
        recorded: list[RecordedSource] = []

        def read_trees(config: Any) -> None:  # before any model is built or sized from the config
            recorded.append(RecordedSource(cfg, int(config.vocab_size), config_context(config)))

        one_process = cfg.distributed.backend == "torch"  # DeepSpeed places each rank's model itself
        device = train_device(cfg.device) if one_process else None  # before any model loads
        models = load_models(
            cfg.model,
            None if cfg.rollout.trees else lambda tok: check_template(cfg, tok, make),
            check_config=read_trees if cfg.rollout.trees else None,
        )
        if device is not None:
            place(models.policy, device)
        check_context(cfg, models.policy)
        if not cfg.rollout.trees:
            check_first_prompt(cfg, models.tokenizer, models.policy, make)
        self.tokenizer = models.tokenizer
        self.reference = models.reference
        self.backend: TrainBackend = make_backend(models.policy, cfg.optim, cfg.distributed, self.on_point)
        place(self.reference, next(self.backend.module.parameters()).device)  # where the policy went
        self.state = TrainerState(update=0, version=0)
        self.identity = ResidentIdentity.of(self.backend.module, tokenizer=models.tokenizer_fingerprint)
        if resume:
            found = resume_state(self.backend, self.run_dir)
            if found is None:  # killed before its first checkpoint: the same run, from the start
                log.warning("--resume: %s has no checkpoint yet; starting from update 0", self.run_dir)
            else:
                self.state = found[0]
                self.identity = replace(self.identity, model_version=self.state.version)
            if self.state.update >= cfg.updates:
                log.warning(
                    "--resume: the run has completed %d updates (updates=%d); nothing to train, raise --updates "
                    "to continue it", self.state.update, cfg.updates,
                )  # fmt: skip
        self.learner = Learner(self.backend, store=ResidentStore(self.identity), ref_model=self.reference)
        self.device = next(self.backend.module.parameters()).device
        self.last_plan: Plan | None = None
        inputs = SourceInputs(
            self.tokenizer, make, self.backend, resolve_model_path(cfg.model.path), start=self.state.update,
            on_episode=self._episode, on_point=self.on_point, sampler=self.sampler,
        )  # fmt: skip
        self.source: TreeSource = recorded[0] if recorded else open_source(cfg, inputs)
        self.evaluator: Evaluator | None = None
        if self.held is not None:  # never with recorded trees: the config refuses eval.every there
            wrapper = wrapper_config(cfg, self.backend.module)
            self.evaluator = Evaluator(cfg, self.held, self.tokenizer, wrapper, self.backend)
        if not resume and overwrite and self.lock is not None:
            remove_run_artifacts(self.run_dir)
        if self.backend.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / SAVED_CONFIG, dump_config(cfg))
        self.metrics = (
            MetricsWriter(self.run_dir, truncate_after=self.state.update) if self.backend.rank == 0 else None
        )

    # ----- one update -------------------------------------------------------------------------------
    def learning_rate(self, index: int) -> float:
        warm = self.cfg.lr_warmup_updates
        return self.cfg.optim.lr * (min(1.0, (index + 1) / warm) if warm else 1.0)

    def update(self, index: int) -> UpdateMetrics:
        """Roll out, run one update (`treetrain.update.run.run_update`), and say what it did."""
        cfg = self.cfg
        trained_at = self.state.version
        if self.phases is not None:
            waiting = self.source.waits_for
            if waiting is None:
                self.phases.sampling()  # counts the episodes as the rollout finishes them
            else:
                self.phases.show(waiting)
        produced = self.source.produce(self.backend.module, index, trained_at)
        if self.on_point is not None:
            self.on_point("update-start", index)
        every = cfg.measure_memory_every
        tracker = MemoryTracker(self.device) if every and index % every == 0 else None
        self.backend.set_learning_rate(self.learning_rate(index))
        if self.phases is not None:  # the first update also calibrates memory (its own bar, below)
            self.phases.show(f"training on {sum(len(t.records) for t in produced.trees)} episodes")
        start = time.perf_counter()
        outcome = run_update(self.learner, cfg, produced.groups, tracker=tracker)
        self.source.trained(index, self.backend.module, self.learner.version)
        if outcome.plan is not None:
            self.last_plan = outcome.plan
        else:
            log.warning("update %d: every group had zero reward variance; no optimizer step", index)
        train_seconds = time.perf_counter() - start
        self.state = TrainerState(update=index + 1, version=self.learner.version)
        return UpdateMetrics.of(
            index, produced, outcome, cfg, trained_at=trained_at, train_seconds=train_seconds,
            data_groups=self.backend.world_size // self.backend.context_size,
        )  # fmt: skip

    # ----- the run ----------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        cfg = self.cfg
        bar = tqdm(
            total=cfg.updates,
            initial=self.state.update,
            desc="train",
            disable=not self.progress or self.backend.rank != 0,
            dynamic_ncols=True,
            mininterval=0,  # an update takes seconds: draw every one, with its own reward, never skip it
            miniters=1,
        )
        history = self.read_rows() if self.state.update > 0 and self.backend.rank == 0 else []
        progress = Progress.after(history if not bar.disable else [])
        self.phases = Phases(
            bar, cfg.rollout.fanout, len(task_seeds(cfg, 0)[self.backend.rank :: self.backend.world_size])
        )
        # log lines (and the inference libraries') go above the bar through tqdm.write instead of being glued onto it
        redirect = logging_redirect_tqdm(_console_loggers()) if not bar.disable else contextlib.nullcontext()
        try:
            try:
                with redirect:
                    self._updates(bar, progress, history)
            finally:
                self.phases = None
                bar.close()
                if self.metrics is not None:
                    self.metrics.close()
            save_trainer_state(self.backend, self.run_dir, self.state, to_dict(cfg))  # always at the end
            self.backend.export_pretrained(self.run_dir / "final", tokenizer=self.tokenizer)
            lora = cfg.model.lora
            if lora is not None and lora.export_merged and self.backend.rank == 0:
                export_merged(
                    cfg.model, self.run_dir / "final", self.run_dir / "final-merged", self.tokenizer
                )
            return self.finish()
        except Exception as exc:  # an interrupt keeps what --resume can use: config.yaml and the marker
            self.abandon_unstarted(exc, completed=self.state.update)
            raise
        finally:
            self.close()

    def _updates(self, bar: tqdm, progress: Progress, history: list[UpdateMetrics]) -> None:
        """The updates still to run, each written, shown (on the bar, or as a log line without one), evaluated
        and checkpointed when due."""
        cfg = self.cfg
        last_saved = time.monotonic()
        if self.state.update == 0:
            self.evaluate()
        for index in range(self.state.update, cfg.updates):
            row = self.update(index)
            if self.metrics is not None:
                self.metrics.write(row)
                history.append(row)
                if bar.disable:  # --no-progress: a line per update
                    log.info("%s", Progress.line(row, cfg.updates))
                advice = no_signal_advice(history)
                if advice is not None:
                    log.warning("%s", advice)
            if self.phases is not None:
                self.phases.show(None)
            self.evaluate()
            if self.on_point is not None:
                self.on_point("update-end", index)
            bar.set_postfix(progress.fields(row), refresh=False)  # shown by the update below
            bar.update(1)
            if self._checkpoint_due(index, last_saved):
                save_trainer_state(self.backend, self.run_dir, self.state, to_dict(cfg))
                last_saved = time.monotonic()

    def _episode(self) -> None:
        """A trajectory of the rollout finished: the bar counts it."""
        if self.phases is not None:
            self.phases.episode()

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

    def evaluate(self) -> None:
        """The held-out evaluation, when one is due after `state.update` updates, written as an eval row."""
        if self.evaluator is None or not self.evaluator.due(self.state.update):
            return
        model = self.backend.module
        if self.phases is not None:
            self.phases.show(f"evaluating {len(self.evaluator.held.seeds)} held-out tasks")
        with self.source.serving(model, self.state.version) as engine:
            row = self.evaluator(
                model, engine, self.state.update, self.state.version, self.source.one_sampler
            )
        if self.phases is not None:
            self.phases.show(None)
        log.info("%s", eval_line(row, self.evaluator.held.source))
        if self.metrics is not None:
            self.metrics.write_eval(row)

    def read_rows(self) -> list[UpdateMetrics]:
        return read_metrics(self.run_dir / "metrics.jsonl")

    def finish(self) -> RunSummary:
        rows = self.read_rows()
        summary = RunSummary.of(rows)
        if self.backend.rank == 0:
            plot_rewards(rows, self.run_dir / "reward.png", evals=read_evals(self.run_dir / "metrics.jsonl"))
            atomic_write_text(self.run_dir / "summary.txt", summary.text(rows) + "\n")
        return summary
