"""`treetrain inspect FILE`: look at a tree file in the terminal, as JSON statistics, or as a DOT graph.

Rendering lives in `treetrain.tree.render`; this module only parses arguments and reports errors. A file
that is not a valid tree file prints the `TreeFormatError` (a `TreetrainError`) message and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from treetrain.errors import TreetrainError
from treetrain.io import atomic_write_bytes
from treetrain.tree.format import load_trees
from treetrain.tree.render import Decoder, RenderOptions, render_trees, to_dot, tokenizer_decoder
from treetrain.tree.stats import tree_stats

EXIT_BAD_INPUT = 2


def _at_least_two(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a tree file: outline, statistics (--json) or a DOT graph (--dot)",
        description="Show the trees in a treetrain tree file (trees/*.msgpack).",
    )
    p.add_argument("file", help="tree file (msgpack, see trees/README.md)")
    p.add_argument("--json", action="store_true", help="print tree statistics as JSON instead of the outline")
    p.add_argument("--dot", metavar="OUT.dot", help="also write a Graphviz DOT drawing (colour = role)")
    p.add_argument("--max-tokens", type=_at_least_two, default=8, metavar="N", help="tokens shown per node")
    p.add_argument("--tokenizer", metavar="DIR", help="local Hugging Face tokenizer dir: show text, not ids")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"treetrain inspect: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def run(args: argparse.Namespace) -> int:
    try:
        trees = load_trees(args.file)
    except TreetrainError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot read {args.file}: {e.strerror or e}")
    decode: Decoder | None = None
    if args.tokenizer:
        try:
            decode = tokenizer_decoder(args.tokenizer)
        except (OSError, ValueError) as e:
            return _fail(f"cannot load tokenizer from {args.tokenizer}: {e}")
    options = RenderOptions(max_tokens=args.max_tokens, decode=decode)
    if args.json:
        doc = {"file": args.file, "trees": [{"id": t.id, "stats": tree_stats(t).as_dict()} for t in trees]}
        print(json.dumps(doc, indent=2))
    else:
        print(render_trees(trees, options))
    if args.dot:
        try:
            atomic_write_bytes(args.dot, to_dot(trees, options).encode("utf-8"))
        except OSError as e:
            return _fail(f"cannot write {args.dot}: {e.strerror or e}")
        print(f"wrote {args.dot}", file=sys.stderr)
    return 0
