"""Context groups measured with `treetrain train`: time per update at C = 2 against C = 1 where both fit,
2 data x 2 context on 4 ranks, and a budget one rank cannot meet, each rank-0 peak against the per-rank
ledger and each step against the one-process step.

    python bench/context_runs.py                          # P = 8000, two groups; a few minutes on 2 cores
    python bench/context_runs.py --out bench/out/context_runs.md
    python bench/context_runs.py --families qwen3,deepseek_v3 --prompt-tokens 2000 --out bench/out/context_families.md

With `--families`, each family's tiny preset (`treetrain.models.presets`) is saved as a checkpoint and
trains one float64 update on imported long-prompt trees, in one process and in a group of 2 (ZeRO 0). Each
family gets one row: the group's step against the one-process step, beside the one-process floor (its tree
step against its flat step). This is the comparison of weights an outside check makes.

The model and trees are `treetrain.benchmark.long_prompt`'s (a 4-layer Llama with 2 KiB of KV per token,
groups of four short answers under one prompt). Each case is one update (SGD, fp32 unless the case says
float64) from the same checkpoint with the run's memory measured (`measure_memory_every=1`), its model's memory
calibrations measured beforehand in this process (`treetrain.train.prewarm`); a row reads rank 0's metrics row (time
per update, its measured live peak and the per-rank ledger's prediction of it, the bytes it put into its
group's collectives) and the final weights, whose step is compared with the one-process step of its dtype
(a float64 case with the float64 one-process case, which Hugging Face's float32 islands bound). A case the
budget refuses is a row with the refusal's line. On a machine of 2 cores the 4-rank case runs 2 processes
per core.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from treetrain.benchmark.long_prompt import write_long_model, write_long_rollouts
from treetrain.bytesize import format_bytes
from treetrain.io import atomic_write_text
from treetrain.models.presets import EAGER_ONLY
from treetrain.train.metrics import read_metrics
from treetrain.train.prewarm import prewarm_calibrations

LAUNCH_TIMEOUT_S = 1200


@dataclass(frozen=True)
class Case:
    """One way to run the update."""

    name: str
    ranks: int = 1
    """Processes (1: `treetrain train` with the one-process backend; more: torchrun and DeepSpeed)."""
    context: int = 1
    """`distributed.context_parallel`."""
    zero: int = 0
    """`distributed.zero_stage` (ignored in one process)."""
    budget: str | None = None
    """`memory_budget` (None: the device's memory)."""
    dtype: str = "float32"
    """`model.dtype` (float64 runs at ZeRO 0, where treetrain reduces the gradients itself)."""
    mode: str = "tree"
    """`mode` (flat: the conventional update, the floor's other side)."""
    device: str = "cpu"
    """'cpu', or 'cuda': one GPU per rank (the launcher's LOCAL_RANK-th), NCCL between them."""

    def settings(self) -> list[str]:
        out = [] if self.budget is None else [f"memory_budget={self.budget}"]
        if self.mode != "tree":
            out.append(f"mode={self.mode}")
        if self.dtype != "float32":
            out.append(f"model.dtype={self.dtype}")
        if self.ranks > 1:  # DeepSpeed places each rank on its accelerator (`DS_ACCELERATOR`, `env`)
            out += ["distributed.backend=deepspeed", f"distributed.zero_stage={self.zero}"]
            out += [f"distributed.context_parallel={self.context}"]
        elif self.device != "cpu":
            out.append(f"device={self.device}")
        return out

    def env(self) -> dict[str, str]:
        """The launch's environment: one thread per rank, and DeepSpeed on the CPU, or left to find the GPU."""
        out = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
        return {**out, "OMP_NUM_THREADS": "1", **({"DS_ACCELERATOR": "cpu"} if self.device == "cpu" else {})}


@dataclass(frozen=True)
class Row:
    """What one case did."""

    case: Case
    refused: str | None
    """The one-line refusal (None: it trained)."""
    train_seconds: float = 0.0
    peak_bytes: int = 0
    """Rank 0's measured live peak beyond parameters and optimizer state."""
    predicted_bytes: int = 0
    """The per-rank ledger's prediction of it."""
    context_bytes: int = 0
    """Bytes rank 0 put into its group's collectives (`metrics.jsonl`'s `context_bytes`)."""
    context_predicted: int = 0
    """The per-rank ledger's prediction of them (`context_bytes_predicted`)."""
    step_error: float = 0.0
    """|step - one-process step| / |one-process step|, against the first case of its dtype (0 for that one)."""


def model_settings(family: str) -> list[str]:
    """What a run of `family`'s checkpoint must set: eager attention where transformers has no other."""
    return ["model.attn=eager"] if family in EAGER_ONLY else []


def prepare(work: Path, prompt_tokens: int, groups: int, family: str = "llama") -> tuple[Path, Path]:
    """The checkpoint and the imported trees (`groups` files of one long prompt each)."""
    model = write_long_model(work / "model", family=family)
    trees = work / "trees"
    for g in range(groups):
        jsonl = write_long_rollouts(work / f"group{g}.jsonl", prompt_tokens=prompt_tokens, seed=g)
        cmd = [sys.executable, "-m", "treetrain", "import", str(jsonl), "--out", str(trees / f"g{g}")]
        subprocess.run(cmd, check=True, capture_output=True)
    return model, trees


def run_case(
    case: Case, work: Path, model: Path, trees: Path, groups: int, family: str = "llama"
) -> tuple[Row, torch.Tensor | None]:
    """Train one update of `case`; its row and its step (None when refused)."""
    run_dir = work / case.name.replace(" ", "_").replace(",", "").replace("=", "")
    settings = [
        f"model.path={model}", f"rollout.groups_per_update={groups}", "updates=1", "checkpoint_every=0",
        "measure_memory_every=1", "optim.name=sgd", "optim.lr=0.5", "optim.grad_clip=0", *case.settings(),
        *model_settings(family),
    ]  # fmt: skip
    args = ["train", "--run-dir", str(run_dir), "--overwrite", "--no-progress", "--trees", str(trees)]
    args += [a for kv in settings for a in ("--set", kv)]
    if case.ranks == 1:
        cmd = [sys.executable, "-m", "treetrain", *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={case.ranks}",
            "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "treetrain", *args,
        ]  # fmt: skip
    done = subprocess.run(cmd, env=case.env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("treetrain train:")]
        if not lines:
            raise RuntimeError(f"{case.name} failed:\n{done.stderr[-3000:]}")
        refused = (
            lines[0].removeprefix("treetrain train: ").split("; the run never started")[0]
        )  # not the path
        return Row(case, refused=refused), None
    (row, *_) = read_metrics(run_dir / "metrics.jsonl")
    start, end = load_file(model / "model.safetensors"), load_file(run_dir / "final" / "model.safetensors")
    step = torch.cat([(end[k].double() - start[k].double()).flatten() for k in sorted(start)])
    measured = Row(
        case,
        None,
        row.train_seconds,
        row.peak_bytes or 0,
        row.predicted_peak_bytes,
        row.context_bytes,
        row.context_bytes_predicted,
    )
    return measured, step


def run_cases(
    cases: list[Case], work: Path, prompt_tokens: int, groups: int, family: str = "llama"
) -> list[Row]:
    """Every case on the same checkpoint and trees; the first of each dtype must train (it is the reference
    step for that dtype)."""
    model, trees = prepare(work, prompt_tokens, groups, family)
    for dtype in sorted({c.dtype for c in cases}):  # no case times the memory calibration's probes
        prewarm_calibrations([f"model.path={model}", f"model.dtype={dtype}", *model_settings(family)])
    rows: list[Row] = []
    references: dict[str, torch.Tensor] = {}
    for case in cases:
        row, step = run_case(case, work, model, trees, groups, family)
        if step is not None:
            reference = references.setdefault(case.dtype, step)
            row = replace(row, step_error=float((step - reference).norm() / reference.norm()))
        rows.append(row)
    return rows


def table(rows: list[Row]) -> list[str]:
    """The markdown table of `rows`, times as ratios to the first row's."""
    base = rows[0].train_seconds
    out = [
        "| case | ranks | C | ZeRO | budget | train s | vs first | rank-0 peak | ledger | measured/ledger "
        "| group bytes | ledger's group bytes | step vs one process |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.case
        head = f"| {c.name} | {c.ranks} | {c.context} | {c.zero if c.ranks > 1 else '-'} | {c.budget or '-'} "
        if r.refused is not None:
            out.append(head + f"| refused: {r.refused} ||||||||")
            continue
        ratio = r.peak_bytes / r.predicted_bytes if r.predicted_bytes else float("nan")
        out.append(
            head + f"| {r.train_seconds:.1f} | {r.train_seconds / base:.2f}x | {format_bytes(r.peak_bytes)} "
            f"| {format_bytes(r.predicted_bytes)} | {ratio:.2f} | {format_bytes(r.context_bytes)} "
            f"| {format_bytes(r.context_predicted)} | {r.step_error:.1e} |"
        )
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


BUDGET = (
    "32MiB"  # one rank's smallest peak at P = 8000 is about 37 MiB; a rank of a group of 2 needs about 30
)
BUDGET_FLOAT64 = "64MiB"  # twice the bytes of every tensor

CASES = [
    Case("one process"),
    Case("2 ranks, C=1", ranks=2, context=1, zero=0),
    Case("2 ranks, C=2", ranks=2, context=2, zero=0),
    Case("2 ranks, C=1, ZeRO-3", ranks=2, context=1, zero=3),
    Case("2 ranks, C=2, ZeRO-3", ranks=2, context=2, zero=3),
    Case("4 ranks, 2x2", ranks=4, context=2, zero=0),
    Case("2 ranks, C=1, budget", ranks=2, context=1, zero=0, budget=BUDGET),
    Case("2 ranks, C=2, budget", ranks=2, context=2, zero=0, budget=BUDGET),
    Case("one process, float64", dtype="float64"),
    Case("2 ranks, C=1, budget, float64", ranks=2, context=1, zero=0, budget=BUDGET_FLOAT64, dtype="float64"),
    Case("2 ranks, C=2, budget, float64", ranks=2, context=2, zero=0, budget=BUDGET_FLOAT64, dtype="float64"),
]


FAMILY_CASES = [
    Case("one process", dtype="float64"),
    Case("one process, flat", dtype="float64", mode="flat"),
    Case("2 ranks, C=2", ranks=2, context=2, zero=0, dtype="float64"),
]


def gpu_cases(devices: int) -> list[Case]:
    """`bench/gpu_check.py`'s context-group cases for a machine of `devices` GPUs, one rank per GPU (NCCL
    refuses two ranks on one device): a group of 2 against one process and 2 ranks of C = 1, in float32
    (time) and in float64 (the step against the one-process step, at ZeRO 0 where float64 reduces
    exactly), and 2 data x 2 context with 4 GPUs. Empty below 2 GPUs.

    >>> [c.name for c in gpu_cases(2)][:3]
    ['one process', '2 ranks, C=1', '2 ranks, C=2']
    >>> gpu_cases(1)
    []
    """
    if devices < 2:
        return []
    cases = [
        Case("one process", device="cuda"),
        Case("2 ranks, C=1", ranks=2, context=1, zero=0, device="cuda"),
        Case("2 ranks, C=2", ranks=2, context=2, zero=0, device="cuda"),
        Case("2 ranks, C=2, ZeRO-3", ranks=2, context=2, zero=3, device="cuda"),
        Case("one process, float64", dtype="float64", device="cuda"),
        Case("2 ranks, C=2, float64", ranks=2, context=2, zero=0, dtype="float64", device="cuda"),
    ]
    if devices >= 4:
        cases.append(Case("4 ranks, 2x2", ranks=4, context=2, zero=0, device="cuda"))
    return cases


def family_line(family: str, rows: list[Row]) -> str:
    """One family's row: the group's step against the one-process step, beside the one-process floor."""
    one, flat, group = rows  # `one` is the reference every step_error is taken against
    refused = one.refused or flat.refused or group.refused
    if refused is not None:
        return f"| {family} | refused: {refused} |||||"
    ratio = group.step_error / flat.step_error if flat.step_error else float("inf")
    same = "yes" if group.context_bytes == group.context_predicted else "no"
    return (
        f"| {family} | {group.step_error:.1e} | {flat.step_error:.1e} | {ratio:.2f} "
        f"| {format_bytes(group.context_bytes)} | {same} |"
    )


def families(names: list[str], prompt_tokens: int, groups: int) -> list[str]:
    """The `--families` table."""
    out = [
        "| family | C = 2 step vs one process | one-process floor (tree vs flat) | ratio | group bytes "
        "| = ledger's |",
        "|---|---|---|---|---|---|",
    ]
    for family in names:
        with tempfile.TemporaryDirectory() as scratch:
            out.append(
                family_line(family, run_cases(FAMILY_CASES, Path(scratch), prompt_tokens, groups, family))
            )
        print(out[-1], flush=True)
    return out


def _write(out: Path, lines: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/context_runs.md"))
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--families", help="comma-separated tiny presets: one float64 row per family")
    args = parser.parse_args()
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    if args.families:
        title = f"# Context groups per family (`python bench/context_runs.py --families ...`), P = {args.prompt_tokens}"
        about = f"{machine}, float64, SGD, one update, ZeRO 0. Steps are relative L2 errors against the one-process tree step."
        _write(
            args.out,
            [title, "", about, "", *families(args.families.split(","), args.prompt_tokens, args.groups), ""],
        )
        return
    with tempfile.TemporaryDirectory() as scratch:
        rows = run_cases(CASES, Path(scratch), args.prompt_tokens, args.groups)
    title = f"# Context groups measured (`python bench/context_runs.py`), P = {args.prompt_tokens}, {args.groups} groups of 4"
    about = (
        f"{machine}, fp32 unless the case says float64, SGD, one update per case, one thread per rank. "
        "`train s` is the update's planning, replay and step (metrics.jsonl `train_seconds`, rank 0); "
        "peaks are rank 0's live bytes beyond parameters and optimizer state."
    )
    _write(args.out, [title, "", about, "", *table(rows), ""])


if __name__ == "__main__":
    main()
