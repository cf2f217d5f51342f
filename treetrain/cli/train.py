"""`treetrain train`: run the training loop. With no arguments it runs the embedded demo."""

from __future__ import annotations

import argparse
import logging
import sys

from treetrain.loss.loss_config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a policy (no arguments: the embedded demo)",
        description=(
            "Run rollout -> score -> advantages -> plan -> replay -> step. Settings come from the defaults "
            "(the demo), then --config, then --set overrides. Multi-process: launch with torchrun or deepspeed "
            "and set distributed.backend=deepspeed."
        ),
    )
    p.add_argument("--config", help="a TOML or YAML config file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one field (repeatable), e.g. --set loss.kl_coef=0.05",
    )
    p.add_argument("--run-dir", help="shorthand for --set run_dir=DIR")
    p.add_argument("--updates", type=int, help="shorthand for --set updates=N")
    p.add_argument("--trees", help="train on recorded trees (a directory or glob) instead of rollouts")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in the run directory"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in the run directory")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from treetrain.train.config import dump_config, load_config

    overrides = list(args.overrides)
    if args.run_dir is not None:
        overrides.append(f"run_dir={args.run_dir}")
    if args.updates is not None:
        overrides.append(f"updates={args.updates}")
    if args.trees is not None:
        overrides.append(f"rollout.trees={args.trees}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"treetrain train: invalid config: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from envs.registry import EnvironmentLoadError, UnknownEnvironmentError
    from envs.wrapper import PromptTooLongError
    from treetrain.distributed.checkpoint_io import CheckpointError
    from treetrain.loss.manifest import ManifestError
    from treetrain.memory.planner import PlanError
    from treetrain.memory.retention import BudgetTooSmallError
    from treetrain.models.support import UnsupportedModelError
    from treetrain.train.env_failures import EnvironmentFailedError
    from treetrain.train.loop import Trainer
    from treetrain.train.metrics import MetricsError
    from treetrain.train.rundir import RunDirError
    from treetrain.tree.format import TreeFormatError

    user_errors = (
        ConfigError, FileNotFoundError, FileExistsError, TreeFormatError, CheckpointError, UnknownEnvironmentError,
        EnvironmentLoadError, UnsupportedModelError, PlanError, BudgetTooSmallError, PromptTooLongError,
        RunDirError, PermissionError, MetricsError, ManifestError, FloatingPointError, EnvironmentFailedError,
    )  # fmt: skip
    try:
        trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
        summary = trainer.run()
    except user_errors as exc:
        print(f"treetrain train: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"treetrain train: interrupted; continue with --resume --run-dir {cfg.run_dir}", file=sys.stderr
        )
        return 130
    if trainer.backend.rank == 0:
        print(summary.text(trainer.read_rows()))
        print(f"run directory: {cfg.run_dir} (metrics.jsonl, reward.png, summary.txt, final/, checkpoints/)")
    return 0
