"""How far `response_only` is from `exact`, per model family: gradient cosine and relative L2.

`exact` is checked against the flat reference (its deviation should sit at the noise floor); `response_only`
detaches resident KV, so it deviates by design. Tiny random-init models exaggerate the prefix-side gradient
compared with trained models, so read these numbers as the contract's shape on this workload, not as a
prediction for a large model.

    python bench/contract_deviation.py [--dtype float64] [--out bench/out/contract_deviation.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from treetrain.engine import ReplayConfig, UpdateBatch
from treetrain.engine.verify import deviation, flat_gradient, noise_floor, tree_gradient
from treetrain.io import atomic_write_text
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.config import LossConfig
from treetrain.loss.manifest import Manifest
from treetrain.models.presets import FAMILIES, tiny_model
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    loss = LossConfig()
    tree = synthetic_group(
        prefix=args.prefix, branches=args.branches, suffix=args.suffix, depth=args.depth, vocab=VOCAB, seed=0
    )
    adv = compute_advantages([tree], AdvantageConfig())
    batch = UpdateBatch.build([tree], adv.trees, Manifest.build([tree], 0), loss)
    lines = [
        f"Tree: prefix {args.prefix}, G={args.branches}, suffix {args.suffix}, depth {args.depth}; {args.dtype}; "
        "tiny random-init models (hidden 32, 2 layers).",
        "",
        "| family | exact vs flat (rel L2) | noise floor (rel) | response_only cosine | response_only rel L2 |",
        "|---|---|---|---|---|",
    ]
    for family in FAMILIES:

        def make(family: str = family) -> torch.nn.Module:
            return tiny_model(family, VOCAB, dtype=dtype, seed=1)

        flat = flat_gradient(make(), batch, loss)
        floor = noise_floor(make, batch, loss)
        exact = deviation(tree_gradient(make(), batch, loss, ReplayConfig(microbatch=4)), flat)
        ro = deviation(tree_gradient(make(), batch, loss, ReplayConfig(contract="response_only", microbatch=4)), flat)
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
