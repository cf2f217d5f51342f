"""`treetrain import IN.jsonl --out DIR`: turn externally sampled rollouts into tree files.

The schema is in `treetrain.rollout.import_records` (and README.md, "Environments"). The library does the work
(`treetrain.rollout.importer.import_jsonl`); an invalid record prints its line number and field and exits
with status 2, having written nothing.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from treetrain.errors import TreetrainError
from treetrain.rollout.importer import GroupBy, import_jsonl
from treetrain.tree.stats import tree_stats

EXIT_BAD_INPUT = 2


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "import",
        help="convert chat-format JSONL rollouts (token ids, logprobs, rewards) into tree files",
        description="Import JSONL rollouts (one record per trajectory or per call) as tree files in DIR.",
    )
    p.add_argument("input", help="JSONL file, one record per line")
    p.add_argument(
        "--out", required=True, metavar="DIR", help="directory for the tree files (created if missing)"
    )
    p.add_argument(
        "--group-by",
        choices=[g.value for g in GroupBy],
        default=GroupBy.PROMPT.value,
        help="one tree per prompt (default) or per group_id field",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        result = import_jsonl(args.input, args.out, GroupBy(args.group_by))
    except (TreetrainError, OSError) as e:
        print(f"treetrain import: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    n_traj = sum(tree_stats(t).num_trajectories for t in result.trees)
    print(f"imported {n_traj} trajectories into {len(result.trees)} trees in {args.out}")
    for path in result.paths:
        print(f"  {path}")
    return 0
