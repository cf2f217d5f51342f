"""`treetrain eval --model DIR --env NAME`: score a checkpoint on held-out tasks (pass@1, pass@k, mean reward).

DIR is a run's `final/`, any Hugging Face model directory, or a run's `checkpoints/update-XXXXX/` (its
weights loaded over the model the run's `config.yaml` names). Settings come from the defaults, or, for a
directory of a run that trained on the same `--env` (and without `--config`), from that run's `config.yaml`
(its `env.kwargs`, rubric, budgets and engine); then `--config`, then `--set` (the engine: `--set
rollout.engine=vllm`; a dataset: `--set env.kwargs.path=...`), then the flags. The tasks are the environment's held-out ones (`treetrain.train.held_out`), sampled through
the training rollout on the chosen engine (`treetrain.train.evaluation`). Everything that can be checked
without a model is checked before torch loads, each problem in one line with exit status 2.

Example:
    treetrain eval --model runs/demo/final --env calculator --tasks 32
    treetrain eval --model runs/mine/final --env dataset --set env.kwargs.path=tasks.jsonl \\
        --set env.kwargs.eval_fraction=0.1 --samples 4 --no-greedy --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from treetrain.errors import ConfigError, TreetrainError

if TYPE_CHECKING:
    from treetrain.train.config import ModelSection, TrainConfig
    from treetrain.train.held_out import HeldOut
    from treetrain.train.metrics import EvalMetrics


def add_parser(sub: argparse._SubParsersAction) -> None:
    from treetrain.cli.option_types import Whole
    from treetrain.train.config import MAX_EVAL_SAMPLES, MAX_EVAL_TASKS

    p = sub.add_parser(
        "eval",
        help="score a checkpoint on held-out tasks (pass@1, pass@k, mean reward)",
        description=(
            "Sample held-out tasks of an environment with a checkpoint (final/, a checkpoint directory, any "
            "Hugging Face directory) through the training rollout, and print pass@1, pass@k and the mean reward."
        ),
    )
    p.add_argument(
        "--model", required=True, help="final/, checkpoints/update-XXXXX/ or a Hugging Face directory"
    )
    p.add_argument(
        "--env", required=True, help="the environment: a built-in name, an entry point or module:Class"
    )
    p.add_argument(
        "--tasks",
        type=Whole(1, MAX_EVAL_TASKS),
        help="held-out tasks to score (shorthand for --set eval.tasks=N)",
    )
    p.add_argument(
        "--samples",
        type=Whole(1, MAX_EVAL_SAMPLES),
        help="samples per task, k of pass@k (--set eval.samples=K)",
    )
    p.add_argument(
        "--greedy", action=argparse.BooleanOptionalAction, default=None,
        help="greedy decoding (the default), or --no-greedy: rollout.sampling's temperature and top-p",
    )  # fmt: skip
    p.add_argument("--config", help="a TOML or YAML config file (engine, env settings, episode budgets)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="override one field (repeatable), e.g. --set rollout.engine=vllm",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def _config(args: argparse.Namespace) -> tuple[TrainConfig, Path | None]:
    """The settings, and the checkpoint weights to load over `model.path` (None: DIR is the model)."""
    from treetrain.io import path_problem
    from treetrain.train.config import check_paths, load_config
    from treetrain.train.eval_weights import check_weight_files
    from treetrain.train.resume import SAVED_CONFIG, saved_config
    from treetrain.train.rundir import is_run_dir

    problem = path_problem(args.model, "directory")
    if problem is not None:
        raise ConfigError(f"--model: {problem}")
    directory = Path(args.model)
    overrides = [*args.overrides, f"env.name={args.env}"]
    for flag, key in ((args.tasks, "eval.tasks"), (args.samples, "eval.samples")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    if args.greedy is not None:
        overrides.append(f"eval.greedy={str(args.greedy).lower()}")
    cfg = load_config(args.config, overrides)
    run = _run_of(directory)
    if args.config is None and run is not None and saved_config(run, "--model").env.name == args.env:
        # the run's own settings (env.kwargs, rubric, budgets, engine) are the base; --set changes them
        cfg = load_config(run / SAVED_CONFIG, overrides)
    weights: Path | None = None
    if (directory / "config.json").is_file():
        model = replace(cfg.model, path=str(directory), lora=None, reference=None)
        check_weight_files(sorted(directory.glob("*.safetensors")), _started_from(run))
    elif os.path.lexists(directory / "model.safetensors") and directory.parent.name == "checkpoints":
        trained = saved_config(directory.parent.parent, "--model")  # the model the weights belong to
        model, weights = replace(trained.model, reference=None), directory / "model.safetensors"
        check_weight_files([weights], trained.model)
    elif (directory / "adapter_config.json").is_file():
        raise ConfigError(
            f"--model: {directory} holds LoRA adapters only; score the run's final-merged/ "
            "(model.lora.export_merged=true) or one of its checkpoints/update-XXXXX/"
        )
    elif is_run_dir(directory) or (directory / "config.yaml").is_file():
        scored = [p for p in ("final-merged", "final") if (directory / p / "config.json").is_file()][-1:]
        raise ConfigError(
            f"--model: {directory} is a run directory, not a model; score "
            + (f"its final model (--model {directory / scored[0]}) or " if scored else "")
            + f"one of its checkpoints (--model {directory / 'checkpoints' / 'update-XXXXX'})"
        )
    else:
        raise ConfigError(
            f"--model: {directory} is neither a model directory (config.json) nor a run's "
            "checkpoints/update-XXXXX/ (model.safetensors, beside the run's config.yaml)"
        )
    cfg = replace(cfg, model=model, loss=replace(cfg.loss, kl_coef=0.0))
    check_paths(cfg)
    return cfg, weights


def _started_from(run: Path | None) -> ModelSection | None:
    """The model the run started from, when its saved config can be read (a whole model directory is
    scored without it; its weights are then compared with its own config.json only when they load)."""
    from treetrain.train.resume import saved_config

    if run is None:
        return None
    try:
        return saved_config(run, "--model").model
    except ConfigError:
        return None


def _run_of(directory: Path) -> Path | None:
    """The run directory `directory` belongs to (its `final/`, `final-merged/` or a checkpoint), or None."""
    if directory.name in ("final", "final-merged"):
        run = directory.parent
    elif directory.parent.name == "checkpoints":
        run = directory.parent.parent
    else:
        return None
    return run if (run / "config.yaml").is_file() else None


def trained_at(directory: Path) -> tuple[int, int]:
    """(updates completed, model version) of the weights in `directory`, as an evaluation row reports them: a
    checkpoint's own trainer state; for a run's `final/` (or `final-merged/`), the run's newest checkpoint
    when `final/` was exported after it (the end of a run writes one, then the other); (0, 0) otherwise."""
    from treetrain.distributed.checkpoint_io import STATE_FILE, CheckpointError, read_client_state

    if directory.parent.name == "checkpoints":
        state_dir: Path | None = directory
    elif directory.name in ("final", "final-merged") and (directory / "config.json").is_file():
        saved = sorted((directory.parent / "checkpoints").glob("update-[0-9]*"))
        state_dir = saved[-1] if saved else None
        if state_dir is not None and _mtime(state_dir / STATE_FILE) > _mtime(directory / "config.json"):
            state_dir = None  # a later run (a resume) checkpointed without exporting: not these weights
    else:
        state_dir = None
    if state_dir is None:
        return 0, 0
    try:
        state = read_client_state(state_dir)
        return int(state["update"]), int(state["version"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return 0, 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")


def run(args: argparse.Namespace) -> int:
    from treetrain.rollout.engines.server_calls import check_reachable
    from treetrain.rollout.env_check import check_environment_config
    from treetrain.train.held_out import held_out_tasks

    try:
        cfg, weights = _config(args)
        held = held_out_tasks(cfg.env.name, cfg.env.kwargs, cfg.eval.tasks)
        e = cfg.env
        check_environment_config(
            e.name, held.kwargs, e.rubric, held.seeds[0], cfg.rollout.episode.step_timeout_s
        )
        if cfg.rollout.engine == "vllm-server":  # before the model loads
            check_reachable(cfg.rollout.vllm.urls, wait_s=cfg.rollout.vllm.startup_wait_s)
    except TreetrainError as exc:
        print(f"treetrain eval: {exc}", file=sys.stderr)
        return 2
    try:
        row = score(cfg, held, weights, trained_at(Path(args.model)))
    except (TreetrainError, OSError) as exc:
        print(f"treetrain eval: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps({**row.as_dict(), "model": args.model, "env": args.env, "engine": cfg.rollout.engine})
        )
    else:
        mode = "greedy" if row.greedy else f"temperature {cfg.rollout.sampling.temperature:g}"
        print(
            f"eval {args.env}: {row.tasks} held-out tasks x {row.samples} sample{'s' if row.samples != 1 else ''} "
            f"({mode}, {cfg.rollout.engine}): "
            f"pass@1 {row.pass_at_1:.3f}, "
            + (f"pass@{row.samples} {row.pass_at_k:.3f}, " if row.samples > 1 else "")
            + f"mean reward {row.reward_mean:.3f}"
            + (f", {row.failed_tasks} tasks failed" if row.failed_tasks else "")
            + f"  [{args.model}]"
        )
    return 0


def score(cfg: TrainConfig, held: HeldOut, weights: Path | None, at: tuple[int, int] = (0, 0)) -> EvalMetrics:
    """Load the model, sample the held-out tasks on `rollout.engine`, and return the scores, reported as
    after `at` = (updates, version) (`trained_at`)."""
    from envs.remote import WorkerEnvFactory
    from treetrain.rollout.engines.factory import make_engine
    from treetrain.rollout.sources.engine_config import engine_spec, wrapper_config
    from treetrain.train.device import place, train_device
    from treetrain.train.eval_weights import load_checkpoint_weights
    from treetrain.train.evaluation import eval_rollout, sample_scores
    from treetrain.train.models import load_models, resolve_model_path
    from treetrain.train.preflight import check_context, check_template

    if cfg.threads is not None:
        import torch

        torch.set_num_threads(cfg.threads)
    factory = WorkerEnvFactory(cfg.env.name, held.kwargs, cfg.rollout.episode.step_timeout_s)
    engine = None
    try:
        device = train_device(cfg.device)  # before the model loads
        models = load_models(cfg.model, lambda tok: check_template(cfg, tok, factory))
        policy = models.policy
        place(policy, device)
        if weights is not None:
            load_checkpoint_weights(policy, weights)
        check_context(cfg, policy)
        policy.eval()
        wrapper = wrapper_config(cfg, policy)
        spec = engine_spec(cfg, policy, world_size=1, checkpoint=resolve_model_path(cfg.model.path))
        engine = make_engine(spec, policy)
        engine.sync_weights(policy, 0)
        with tempfile.TemporaryDirectory(prefix="treetrain-eval-") as out:
            start = time.perf_counter()
            scores = sample_scores(
                policy, models.tokenizer, factory, held.seeds, Path(out), engine=engine,
                config=eval_rollout(cfg, wrapper), env_name=cfg.env.name,
            )  # fmt: skip
            seconds = time.perf_counter() - start
    finally:
        if engine is not None:
            engine.close()
        factory.close()
    return scores.metrics(*at, cfg.eval.pass_threshold, seconds, cfg.eval.greedy)
