"""The ledger's predicted peak against the measured one for models with recurrent layers beside attention.

Each geometry is one synthetic tree (prefix P, G branches of S tokens, depth d), run in `exact`,
`response_only` and flat, one process, with a `MemoryTracker` (live tensor bytes, exact on CPU). The
comparison is on the dynamic bytes (everything but parameters), as in tests/memory/test_ledger.py, whose
tolerance is 10 %. Byte counts only, never timing: the run takes about a minute per model on 2 cores.

    python bench/recurrent_ledger.py                                  # tiny Qwen3.5 (Gated DeltaNet + attention)
    python bench/recurrent_ledger.py --model nemotron_h --model llama   # a Mamba-2 hybrid; a KV-only control
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treetrain.bytesize import format_bytes
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.flat_cost import predict_flat
from treetrain.memory.ledger import predict_ledger
from treetrain.memory.tracker import MemoryTracker
from treetrain.models.presets import EAGER_ONLY, tiny_model
from treetrain.replay import ReplayConfig, TreeReplay, UpdateBatch
from treetrain.replay.flat_reference import FlatReference
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.tree.synthetic import synthetic_group

LOSS = LossConfig()
VOCAB = 64
GEOMETRIES: tuple[tuple[int, int, int, int], ...] = (
    # prefix, branches (G), suffix, depth: test_ledger.py's grid shapes, and a longer prefix
    (48, 4, 12, 1),
    (96, 8, 16, 2),
    (24, 6, 40, 2),
    (512, 4, 32, 1),
)
MODES = ("exact", "response_only", "flat")


@dataclass(frozen=True)
class Row:
    """One geometry and mode: the ledger's dynamic peak and the tracker's."""

    geometry: tuple[int, int, int, int]
    mode: str
    predicted: int
    measured: int

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def make_batch(prefix: int, branches: int, suffix: int, depth: int) -> UpdateBatch:
    rewards = [float(i % 3 == 0) for i in range(branches)]
    tree = synthetic_group(
        prefix=prefix, branches=branches, suffix=suffix, depth=depth, vocab=VOCAB, seed=1, rewards=rewards
    )
    adv = compute_advantages([tree], AdvantageConfig())
    return UpdateBatch.build([tree], adv.trees, LOSS)


def measure(model: PreTrainedModel, batch: UpdateBatch, mode: str) -> tuple[int, int]:
    """(predicted, measured) dynamic peak bytes of one update of `batch` in `mode`."""
    for p in model.parameters():  # the ledger books gradients for the whole window
        p.grad = torch.zeros_like(p)
    tracker = MemoryTracker()
    if mode == "flat":
        tracker.attach_model(model)
        with tracker:
            FlatReference(model, LOSS).accumulate(batch)
        tracker.detach()
        predicted = predict_flat(batch, model, LOSS)[0].peak.dynamic
        return predicted, tracker.peak.dynamic
    replay = ReplayConfig(contract=mode, microbatch=2)  # type: ignore[arg-type]
    report = TreeReplay(model, LOSS, replay, hooks=ReplayHooks(tracker=tracker)).accumulate(batch)
    tracker.detach()
    assert report.measured_peak is not None
    return predict_ledger(batch, model, replay, LOSS).peak.dynamic, report.measured_peak.dynamic


def run(family: str) -> list[Row]:
    model = tiny_model(family, VOCAB, attn="eager" if family in EAGER_ONLY else "sdpa")
    rows = []
    for geometry in GEOMETRIES:
        batch = make_batch(*geometry)
        for mode in MODES:
            rows.append(Row(geometry, mode, *measure(model, batch, mode)))
    return rows


def table(family: str, rows: list[Row]) -> str:
    lines = [
        f"tiny {family}, dynamic peak (everything but parameters), K = 2:",
        "",
        "| P | G | S | d | mode | ledger | measured | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, g, s, d = r.geometry
        lines.append(
            f"| {p} | {g} | {s} | {d} | {r.mode} | {format_bytes(r.predicted)} | {format_bytes(r.measured)} "
            f"| {r.error:+.1%} |"
        )
    worst = max(rows, key=lambda r: abs(r.error))
    lines.append("")
    lines.append(f"worst: {worst.error:+.1%} ({worst.mode} at P = {worst.geometry[0]})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="tiny preset family (repeatable); qwen3_5_text")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for family in args.model or ["qwen3_5_text"]:
        print(table(family, run(family)))
        print()


if __name__ == "__main__":
    main()
