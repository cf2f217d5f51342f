"""The benchmark's markdown report and PNG plots.

`markdown(results)` gives four sections: how it was run; speed (median seconds per update, measured and
token-ceiling speedups and their ratio); peak memory by lifetime class, measured and predicted; the
longest prefix within the memory limit per mode; and the targets, each met or missed by how much.
`write_plots(results, out_dir)` draws the same numbers.

Example:
    >>> print(mib(3 * 2**20))
    3.0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treetrain.benchmark.bench_config import MODES, Mode
from treetrain.benchmark.longest_prefix import PrefixFit
from treetrain.benchmark.results import BenchResults, Check, all_checks
from treetrain.bytesize import format_bytes
from treetrain.io import atomic_write_bytes
from treetrain.lifetime import CLASSES, ClassBytes

SHORT = {"flat": "flat", "exact": "exact", "response_only": "resp-only"}


def publish(text: str, out: Path | None) -> None:
    """A bench script's markdown: to stdout, and written atomically to `out` when given."""
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out, text.encode("utf-8"))


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def setup_lines(results: BenchResults) -> list[str]:
    c, m, spec = results.config, results.machine, results.config.model
    return [
        f"Command: `{m.command}`",
        "",
        f"Machine: {m.host}; torch {m.torch}, {m.threads} thread(s). Date: {m.date}. "
        f"Wall time {m.wall_seconds / 60:.1f} min.",
        "",
        f"Model: random-init {spec.family}, hidden {spec.hidden_size}, {spec.num_layers} layers, MLP "
        f"{spec.intermediate_size}, {spec.num_heads} heads / {spec.num_kv_heads} KV heads, vocab {spec.vocab_size}, "
        f"{spec.dtype}, {spec.attn}. Flat: {c.flat_microbatch} trajectory per microbatch. Tree modes: K = "
        f"{c.microbatch} branches per step, chunks of {c.chunk_size} tokens. Loss: PPO-clip, sampler logprobs "
        "(no scoring pass). Time per update = gradient accumulation (forward and backward), optimizer step "
        f"excluded; median of {c.reps} interleaved repetitions (modes in rotating order).",
    ]


def speed_table(results: BenchResults) -> list[str]:
    head = ["P", "G", "S", "d", "flat s"]
    for mode in MODES[1:]:
        short = SHORT[mode]
        head += [f"{short} s", f"{short} ×", f"{short} ceiling ×", f"{short} ratio"]
        head += [f"{short} FLOP ceiling ×", f"{short} FLOP ratio"]
    rows = []
    for r in results.points:
        p = r.point
        row = [str(p.prefix), str(p.branches), str(p.suffix), str(p.depth), f"{r.mode('flat').median:.3g}"]
        for mode in MODES[1:]:
            row += [
                f"{r.mode(mode).median:.3g}",
                f"{r.speedup(mode):.2f}",
                f"{r.ceiling(mode):.2f}",
                f"{r.ratio(mode):.2f}",
                f"{r.flop_ceiling(mode):.2f}" if r.flop_ceiling(mode) else "–",
                f"{r.flop_ratio(mode):.2f}" if r.flop_ceiling(mode) else "–",
            ]
        rows.append(row)
    return _table(head, rows)


def repetitions_table(results: BenchResults) -> list[str]:
    """Every timed repetition, in the order run, so the spread behind each median is visible."""
    head = ["P", "G", "S", "d", *[f"{SHORT[m]} s (each rep)" for m in MODES]]
    rows = []
    for r in results.points:
        p = r.point
        cells = [" ".join(f"{t:.3g}" for t in r.mode(m).seconds) for m in MODES]
        rows.append([str(p.prefix), str(p.branches), str(p.suffix), str(p.depth), *cells])
    return _table(head, rows)


def _err(measured: ClassBytes, predicted: ClassBytes) -> str:
    if not measured.total:
        return ""
    return f"{100 * (predicted.total - measured.total) / measured.total:+.1f}%"


def memory_table(results: BenchResults) -> list[str]:
    head = [
        "P",
        "G",
        "S",
        "d",
        "mode",
        *[f"{c} MiB (m / p)" for c in CLASSES],
        "total MiB (m / p)",
        "pred. error",
    ]
    rows = []
    for r in results.points:
        p = r.point
        for mode in MODES:
            m = r.mode(mode)
            cells = [f"{mib(m.measured.get(c))} / {mib(m.predicted.get(c))}" for c in CLASSES]
            rows.append(
                [str(p.prefix), str(p.branches), str(p.suffix), str(p.depth), SHORT[mode], *cells,
                 f"{mib(m.measured.total)} / {mib(m.predicted.total)}", _err(m.measured, m.predicted)]
            )  # fmt: skip
    return _table(head, rows)


def memory_summary_table(results: BenchResults) -> list[str]:
    """Per point: each mode's measured peak (predicted in brackets), and the prompt-group share."""
    head = ["P", "G", "S", "d", *[f"{SHORT[m]} MiB" for m in MODES], "exact prompt-group MiB"]
    rows = []
    for r in results.points:
        p = r.point
        cells = [f"{mib(r.mode(m).measured.total)} ({mib(r.mode(m).predicted.total)})" for m in MODES]
        rows.append(
            [str(p.prefix), str(p.branches), str(p.suffix), str(p.depth), *cells,
             mib(r.mode("exact").measured.prompt_group)]
        )  # fmt: skip
    return _table(head, rows)


def _fit_cell(f: PrefixFit) -> str:
    """`7616 (K=4, confirmed)`; a corrected answer also shows the prediction it replaced."""
    text = ("≥" if f.capped else "") + str(f.prefix)
    notes = [] if f.mode == "flat" else [f"K={f.microbatch}"]
    if f.judged == "corrected":
        notes.append(f"corrected from {f.predicted_prefix}")
    elif f.judged != "measured":
        notes.append(f.judged)
    return text + (f" ({', '.join(notes)})" if notes else "")


def budget_table(results: BenchResults) -> list[str]:
    head = ["G", "S", "d", *[f"{SHORT[m]} longest P" for m in MODES], "exact ÷ flat", "resp-only ÷ flat"]
    head.append("measured peak at P, MiB (flat / exact / resp-only)")
    rows = []
    for g, s, d in results.config.shapes():
        found = [results.fit(g, s, d, m) for m in MODES]
        fits = [f for f in found if f is not None]
        if len(fits) != len(MODES):
            continue
        flat = fits[0].prefix
        ratios = [("≥" if f.capped else "") + (f"{f.prefix / flat:.1f}" if flat else "∞") for f in fits[1:]]
        measured = [mib(f.measured.total) if f.measured is not None else "–" for f in fits]
        rows.append([str(g), str(s), str(d), *[_fit_cell(f) for f in fits], *ratios, " / ".join(measured)])
    return _table(head, rows)


def check_lines(checks: tuple[Check, ...]) -> list[str]:
    lines = []
    for target in ("speed", "memory", "budget", "growth"):
        group = [c for c in checks if c.target == target]
        if not group:
            continue
        missed = [c for c in group if not c.met]
        graded = [c for c in group if c.bound > 0]  # flat's growth is shown for comparison only
        lines.append(f"- **{target}**: {len(graded) - len(missed)} of {len(graded)} met.")
        for c in missed:
            lines.append(f"  - missed at {c.where}: {c.note}")
        if target == "growth":
            lines += [f"  - {c.where}: {c.note}" for c in group if c.met]
    return lines


def markdown(results: BenchResults) -> str:
    c = results.config
    lines = ["# Geometry benchmark", "", *setup_lines(results), ""]
    lines += [
        "## Speed",
        "",
        "Seconds per update; × = speedup against flat; ratio = measured ÷ ceiling (token ceiling, and the "
        "FLOP ceiling with attention priced in, `treetrain.benchmark.flops`).",
        "",
    ]
    lines += speed_table(results)
    lines += ["", "Every repetition (seconds, in the order run):", ""]
    lines += repetitions_table(results)
    lines += ["", "## Peak memory", "", "Measured peak over all classes (predicted in brackets).", ""]
    lines += memory_summary_table(results)
    lines += ["", "## Peak memory by lifetime class", ""]
    lines += [
        "Measured (m: live tensor bytes, `MemoryTracker`) and predicted (p: `predict_ledger` for the tree "
        "modes; the same calibrated memory model for flat). Gradients are allocated before the update.",
        "",
    ]
    lines += memory_table(results)
    lines += ["", f"## Longest prefix within {format_bytes(c.memory_limit)}", ""]
    lines += [
        f"Search in steps of {c.search_step} tokens, up to {c.max_search_prefix} (≥: the cap fits), of the "
        "peak over all classes (`treetrain.benchmark.longest_prefix`). Flat: against measured peaks (one trajectory "
        "per microbatch). Tree modes: against the ledger's prediction, lowering K when that fits a longer "
        "prefix; where a measured peak is shown, the answer was checked by measured runs (confirmed: it "
        "fits; corrected: it did not, and a measured search below it gave the answer shown).",
        "",
    ]
    lines += budget_table(results)
    lines += ["", "## Targets", ""]
    lines += check_lines(all_checks(results))
    return "\n".join(lines) + "\n"


# ----- plots ------------------------------------------------------------------------------------------------
def write_plots(results: BenchResults, out_dir: Path) -> list[Path]:
    """speedup.png, memory.png and longest_prefix.png in `out_dir`; returns the paths."""
    from treetrain.viz._mpl import pyplot

    plt = pyplot()
    paths = []
    for name, draw in (("speedup", _plot_speed), ("memory", _plot_memory), ("longest_prefix", _plot_budget)):
        fig = draw(results, plt)
        path = out_dir / f"{name}.png"
        tmp = out_dir / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        atomic_write_bytes(path, tmp.read_bytes())
        tmp.unlink()
        paths.append(path)
    return paths


def _labels(results: BenchResults) -> list[str]:
    return [f"{r.point.prefix}/{r.point.branches}/{r.point.suffix}/{r.point.depth}" for r in results.points]


def _plot_speed(results: BenchResults, plt: Any) -> Any:
    import numpy as np

    fig, ax = plt.subplots(figsize=(max(8.0, 0.5 * len(results.points) + 2), 4.2))
    x = np.arange(len(results.points))
    tree_modes: tuple[tuple[Mode, str], ...] = (("exact", "#4e79a7"), ("response_only", "#f28e2b"))
    for i, (mode, colour) in enumerate(tree_modes):
        meas = [r.speedup(mode) for r in results.points]
        ceil = [r.ceiling(mode) for r in results.points]
        ax.bar(x + (i - 0.5) * 0.4, meas, 0.38, color=colour, label=f"{mode} measured")
        ax.plot(x + (i - 0.5) * 0.4, ceil, "k_", ms=14, mew=2, label="token ceiling" if i == 0 else None)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(x, _labels(results), rotation=70, fontsize=7)
    ax.set_xlabel("prefix / G / suffix / depth")
    ax.set_ylabel("speedup against flat")
    ax.legend(fontsize=7, ncols=2)
    ax.set_title("measured vs token-ceiling speedup", fontsize=10)
    fig.tight_layout()
    return fig


def _plot_memory(results: BenchResults, plt: Any) -> Any:
    import numpy as np

    from treetrain.viz.ledger_plot import STACK

    fig, ax = plt.subplots(figsize=(max(8.0, 0.6 * len(results.points) + 2), 4.5))
    x = np.arange(len(results.points))
    width = 0.27
    for i, mode in enumerate(MODES):
        bottom = np.zeros(len(x))
        for cls, colour, label in STACK:
            h = np.array([r.mode(mode).measured.get(cls) for r in results.points]) / 2**20
            ax.bar(x + (i - 1) * width, h, width, bottom=bottom, color=colour, label=label if i == 0 else None,
                   edgecolor="white", linewidth=0.3)  # fmt: skip
            bottom += h
        pred = [r.mode(mode).predicted.total / 2**20 for r in results.points]
        ax.plot(x + (i - 1) * width, pred, "k_", ms=8, label="predicted total" if i == 0 else None)
    ax.set_xticks(x, _labels(results), rotation=70, fontsize=7)
    ax.set_xlabel("prefix / G / suffix / depth   (bars: flat, exact, response_only)")
    ax.set_ylabel("peak MiB (measured)")
    ax.legend(fontsize=7)
    ax.set_title("peak memory by lifetime class", fontsize=10)
    fig.tight_layout()
    return fig


def _plot_budget(results: BenchResults, plt: Any) -> Any:
    import numpy as np

    shapes = results.config.shapes()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(shapes) + 2), 4.0))
    x = np.arange(len(shapes))
    for i, (mode, colour) in enumerate(zip(MODES, ("#8c8c8c", "#4e79a7", "#f28e2b"))):
        fits = [results.fit(g, s, d, mode) for g, s, d in shapes]
        ax.bar(x + (i - 1) * 0.27, [f.prefix if f else 0 for f in fits], 0.27, color=colour, label=mode)
    ax.set_xticks(x, [f"G={g} S={s} d={d}" for g, s, d in shapes], rotation=30, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("longest prefix (tokens)")
    ax.set_title(f"longest prefix within {format_bytes(results.config.memory_limit)}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
