"""`treetrain inspect PATH...`: look at trees in the terminal, as JSON statistics, or as a DOT graph.

Each PATH is a tree file, a directory of them or a run directory (`treetrain.viz.tree_files` finds the
trees); rendering lives in `treetrain.tree.render`. This module only parses arguments and reports errors: a
path that is missing or holds no trees, or a file that is not a valid tree file, prints one line naming it
(a `TreetrainError`) and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from typing import Any

from treetrain.cli.option_types import Whole
from treetrain.diskfull import DiskFullError
from treetrain.errors import TreetrainError
from treetrain.io import atomic_write_bytes, output_problem, path_problem
from treetrain.tree.render import Decoder, RenderOptions, render_trees, to_dot, tokenizer_decoder
from treetrain.tree.stats import tree_stats
from treetrain.viz.tree_files import NamedTree, load_tree_sources

EXIT_BAD_INPUT = 2
MAX_TOKENS_SHOWN = 1 << 20
"""Largest `--max-tokens` (tokens shown per node; more than any node of a tree file holds)."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show trees (files, directories, run directories): outline, statistics (--json) or DOT (--dot)",
        description="Show the trees in tree files (trees/*.msgpack), directories of them, or run directories.",
    )
    p.add_argument(
        "paths", nargs="+", metavar="PATH",
        help="tree file (msgpack, see trees/README.md), or a directory or run directory searched for *.msgpack",
    )  # fmt: skip
    p.add_argument(
        "--json",
        action="store_true",
        help="print each tree's statistics, token-ceiling costs, sampling settings and node versions as JSON (docs/tree-format.md)",
    )
    p.add_argument("--dot", metavar="OUT.dot", help="also write a Graphviz DOT drawing (colour = role)")
    p.add_argument(
        "--max-tokens", type=Whole(2, MAX_TOKENS_SHOWN), default=8, metavar="N", help="tokens shown per node"
    )
    p.add_argument("--tokenizer", metavar="DIR", help="local Hugging Face tokenizer dir: show text, not ids")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"treetrain inspect: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _load(paths: list[str]) -> list[NamedTree]:
    """Every tree under every path, in argument order, each named by its file (and `#i` in a group)."""
    out: list[NamedTree] = []
    for path in paths:
        found = load_tree_sources(path)
        sizes = Counter(t.path for t in found)
        out.extend(
            NamedTree(str(t.path) if sizes[t.path] == 1 else f"{t.path}#{t.index}", t.path, t.index, t.tree)
            for t in found
        )
    return out


def run(args: argparse.Namespace) -> int:
    try:
        named = _load(args.paths)
    except TreetrainError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot read {e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    if args.dot and (problem := output_problem(args.dot)):
        return _fail(f"--dot: {problem}")
    decode: Decoder | None = None
    if args.tokenizer and (problem := path_problem(args.tokenizer, "directory")):
        return _fail(f"--tokenizer: {problem}")
    if args.tokenizer:
        from treetrain.models.tokenizer_files import check_tokenizer_dir, load_failure

        try:
            check_tokenizer_dir(args.tokenizer)  # before transformers reads a byte of it
            decode = tokenizer_decoder(args.tokenizer)
        except TreetrainError as e:
            return _fail(f"--tokenizer: {e}")
        # transformers and tokenizers raise many types (even a bare Exception) for bad tokenizer files
        except Exception as e:
            return _fail(f"--tokenizer: {load_failure(args.tokenizer, e)}")
    options = RenderOptions(max_tokens=args.max_tokens, decode=decode)
    trees = [t.tree for t in named]
    if args.json:
        doc = {
            "paths": args.paths,
            "trees": [
                {
                    "name": t.name,
                    "file": str(t.path),
                    "id": t.tree.id,
                    "stats": tree_stats(t.tree).as_dict(),
                    "sampling": None if t.tree.sampling is None else dataclasses.asdict(t.tree.sampling),
                    "node_versions": [list(v) for v in t.tree.node_versions],
                }
                for t in named
            ],
        }
        print(json.dumps(doc, indent=2))
    else:
        print("\n\n".join(f"{t.name}: {render_trees([t.tree], options)}" for t in named) if len(named) > 1
              else render_trees(trees, options))  # fmt: skip
    if args.dot:
        try:
            atomic_write_bytes(args.dot, to_dot(trees, options).encode("utf-8"))
        except DiskFullError as e:
            return _fail(
                f"cannot write {args.dot}: {e.with_remedy(f'{e.remedy} or give --dot a path elsewhere')}"
            )
        except OSError as e:
            return _fail(f"cannot write {args.dot}: {e.strerror or e}")
        print(f"wrote {args.dot}", file=sys.stderr)
    return 0
