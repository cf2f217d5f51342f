"""`treetrain` command line. Each subcommand lives in its own module and exposes `add_parser(subparsers)`;
the parser stores the function to run in `func`. This file only wires them together, and turns any
`TreetrainError` (bad input) a verb lets through into one line and exit status 2."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from treetrain.errors import TreetrainError

#: Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS: tuple[str, ...] = (
    "treetrain.cli.train",
    "treetrain.cli.inspect",
    "treetrain.cli.import_",
    "treetrain.cli.plan",
    "treetrain.cli.eval",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treetrain",
        description="Prefix-tree RL trainer for LLM agents.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the verb's own parser, so the usage shown is the verb's
        verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        verbs.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except TreetrainError as exc:  # bad input a verb did not word itself: still one line, never a traceback
        print(f"treetrain {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `treetrain inspect FILE | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
