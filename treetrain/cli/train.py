"""`treetrain train`: run the training loop. With no arguments it runs the embedded demo."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from treetrain.cli.option_types import Whole
from treetrain.diskfull import as_disk_full, is_disk_full
from treetrain.errors import ConfigError, TreetrainError

MAX_UPDATES = 10**9
"""Largest `--updates` (at a second an update, thirty years)."""


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
    p.add_argument("--updates", type=Whole(1, MAX_UPDATES), help="shorthand for --set updates=N")
    p.add_argument("--trees", help="train on recorded trees (a directory or glob) instead of rollouts")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the run directory from its latest checkpoint, with its saved config.yaml "
        "(--set may change only updates, checkpoint and measurement cadence, threads and memory_budget)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in the run directory")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument(
        "--no-progress", action="store_true",
        help="no progress bars (treetrain's per-update bar and transformers' weight loading): plain log lines",
    )  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from treetrain.train.config import check_paths, config_template, dump_config, load_config

    overrides = list(args.overrides)
    if args.run_dir is not None:
        overrides.append(f"run_dir={args.run_dir}")
    if args.updates is not None:
        overrides.append(f"updates={args.updates}")
    if args.trees is not None:
        overrides.append(f"rollout.trees={args.trees}")
    try:
        cfg = load_config(args.config, overrides)
        if not args.print_config:
            check_paths(cfg)
    except ConfigError as exc:
        print(f"treetrain train: invalid config: {exc}", file=sys.stderr)
        return 2
    if args.print_config and not args.resume:
        print(config_template(cfg), end="")
        return 0
    if args.resume:  # the run's own saved settings, changed only where that is safe (before torch loads)
        from treetrain.train.resume import resume_config

        try:
            cfg = resume_config(cfg.run_dir, args.config, overrides)
        except (TreetrainError, OSError) as exc:
            print(f"treetrain train: {exc}", file=sys.stderr)
            return 2
        if args.print_config:  # what the resume would run with
            print(dump_config(cfg), end="")
            return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from treetrain.train.preflight import preflight
    from treetrain.train.rundir import is_run_dir

    try:  # every mistake seen without torch is answered before it loads (seconds, not a minute)
        checked = preflight(cfg, resume=args.resume, overwrite=args.overwrite)
    except (TreetrainError, OSError) as exc:
        if is_disk_full(exc):  # marking the run directory can meet a full disk too
            exc = as_disk_full(exc, cfg.run_dir, "use another --run-dir")
        print(f"treetrain train: {exc}", file=sys.stderr)
        return 2
    if args.no_progress:
        from treetrain.train.progress import hide_library_bars

        hide_library_bars()  # imports transformers
    from treetrain.cli.termination import EXIT_CODE, Terminated, sigterm_interrupts
    from treetrain.rollout.sources.sampler_start import early_sampler
    from treetrain.train.loop import Trainer

    sampler = early_sampler(cfg, fresh=True)  # the hf sampler's process, before anything is computed
    with sigterm_interrupts() as stops:  # a scheduler's stop, or torchrun stopping the ranks when one failed
        try:
            trainer = Trainer(
                cfg,
                resume=args.resume,
                overwrite=args.overwrite,
                progress=not args.no_progress,
                checked=checked,
                sampler=sampler,
            )
            summary = trainer.run()
        except Exception as exc:
            stops.ignore()  # stopping already: torchrun's SIGTERM after a lost rank must not cut the line
            return _failed(exc, cfg.run_dir)
        except KeyboardInterrupt as stop:
            stops.ignore()
            what, code = (
                ("stopped by SIGTERM", EXIT_CODE) if isinstance(stop, Terminated) else ("interrupted", 130)
            )
            if is_run_dir(Path(cfg.run_dir)):
                print(
                    f"treetrain train: {what}; continue with --resume --run-dir {cfg.run_dir}",
                    file=sys.stderr,
                )
            else:
                print(f"treetrain train: {what} before the run started; nothing was kept", file=sys.stderr)
            return code
    if trainer.backend.rank == 0:
        from treetrain.train.summary import run_contents

        print(summary.text(trainer.read_rows()))
        print(f"run directory: {cfg.run_dir} ({run_contents(Path(cfg.run_dir))})")
    return 0


def _failed(exc: Exception, run_dir: str) -> int:
    """The one line for a run that raised: another rank lost, bad input, the disk, a non-finite step; a bug
    (any other exception) is raised again, with its traceback."""
    from treetrain.distributed.lost_rank import lost_rank, lost_rank_line

    collective = lost_rank(exc)
    if collective is not None:  # another rank died mid-collective: this one stops with it
        print(f"treetrain train: {lost_rank_line(collective, run_dir)}", file=sys.stderr)
        return 2
    if is_disk_full(exc):  # the place that was full, advised for (another --run-dir only for the run's)
        exc = as_disk_full(exc, run_dir, "use another --run-dir")
    elif not isinstance(exc, (TreetrainError, OSError, FloatingPointError)):
        raise exc
    notes = getattr(exc, "__notes__", [])  # e.g. what a run that never started left behind
    print("; ".join([f"treetrain train: {exc}", *notes]), file=sys.stderr)
    return 2
