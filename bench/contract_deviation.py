"""How far `response_only` is from `exact`, per model family: gradient cosine and relative L2.

`exact` is checked against the flat reference (its deviation should sit at the noise floor); `response_only`
detaches resident KV, so it deviates by design. Tiny random-init models exaggerate the prefix-side gradient
compared with trained models, so read these numbers as the contract's shape on this workload, not as a
prediction for a large model.

    python bench/contract_deviation.py [--dtype float64] [--out bench/out/contract_deviation.md]
    python bench/contract_deviation.py --model treetrain/assets/demo_model \
        --trees 'runs/demo/rollouts/update-00000/trees/*.msgpack' --out bench/out/contract_deviation_demo.md
"""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

import torch

from treetrain.io import atomic_write_text
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.models.presets import FAMILIES, load_model, tiny_model
from treetrain.replay import ReplayConfig, UpdateBatch
from treetrain.replay.verify import deviation, flat_gradient, noise_floor, tree_gradient
from treetrain.tree.format import load_trees
from treetrain.tree.synthetic import synthetic_group

VOCAB = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/out/contract_deviation.md"))
    parser.add_argument("--model", help="a local checkpoint instead of the tiny random-init families")
    parser.add_argument("--trees", help="recorded tree files (glob) instead of a synthetic tree")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    loss = LossConfig()
    if args.trees:
        trees = [t for f in sorted(glob.glob(args.trees)) for t in load_trees(f)]
        if not trees:
            raise SystemExit(f"no trees at {args.trees!r}")
        what = f"{len(trees)} recorded trees ({args.trees})"
    else:
        trees = [
            synthetic_group(
                prefix=args.prefix,
                branches=args.branches,
                suffix=args.suffix,
                depth=args.depth,
                vocab=VOCAB,
                seed=0,
            )
        ]
        what = f"prefix {args.prefix}, G={args.branches}, suffix {args.suffix}, depth {args.depth}"
    advantages = [compute_advantages([t], AdvantageConfig(zero_variance="keep")).trees[0] for t in trees]
    batch = UpdateBatch.build(trees, advantages, loss)
    models = (
        {Path(args.model).name: lambda: load_model(args.model, dtype=dtype)}
        if args.model
        else {
            f: (lambda f=f: tiny_model(f, VOCAB, dtype=dtype, seed=1))  # type: ignore[misc]
            for f in FAMILIES
        }
    )
    kind = "the given checkpoint" if args.model else "tiny random-init models (hidden 32, 2 layers)"
    lines = [
        f"Trees: {what}; {args.dtype}; {kind}.",
        "",
        "| model | exact vs flat (rel L2) | noise floor (rel) | response_only cosine | response_only rel L2 |",
        "|---|---|---|---|---|",
    ]
    for family, make in models.items():
        flat = flat_gradient(make(), batch, loss)
        floor = noise_floor(make, batch, loss)
        exact = deviation(tree_gradient(make(), batch, loss, ReplayConfig(microbatch=4)), flat)
        ro = deviation(
            tree_gradient(make(), batch, loss, ReplayConfig(contract="response_only", microbatch=4)), flat
        )
        norm = float(flat.norm())
        lines.append(
            f"| {family} | {exact.rel:.2e} | {floor / norm:.2e} | {ro.cosine:.5f} | {100 * ro.rel:.2f}% |"
        )
        print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
