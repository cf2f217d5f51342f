"""Plot a memory ledger: predicted bytes per lifetime class over the replay's events, measured on top.

`treetrain.memory.ledger.predict_ledger` gives one row per event the engine will run (scoring batches,
recomputes, replay steps), with bytes by lifetime class at that event's peak moment. This draws them as
stacked bars, persistent at the bottom, then update-boundary gradients, prompt-group resident KV (and KV
gradients), and replay-temporary graphs on top, and marks the predicted peak. Given the segments a
`MemoryTracker` recorded during the same replay, the measured peak of each event is drawn as a dot, so a
wrong prediction is visible at the event where it goes wrong.

Example:
    >>> ledger = predict_ledger(batch, model, replay, loss)                             # doctest: +SKIP
    >>> ax = plot_ledger(ledger, measured=tracker.segments)                             # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from treetrain.lifetime import LifetimeClass
from treetrain.viz._mpl import pyplot

if TYPE_CHECKING:
    from treetrain.memory.ledger import Ledger
    from treetrain.memory.tracker import MeasuredSegment

#: Drawing order, bottom to top, and colours.
STACK: tuple[tuple[LifetimeClass, str, str], ...] = (
    ("persistent", "#8c8c8c", "run-persistent (params, optimizer, reference)"),
    ("boundary", "#b07aa1", "update-boundary (accumulated grads)"),
    ("prompt_group", "#4e79a7", "prompt-group (resident KV, KV grads)"),
    ("temporary", "#f28e2b", "replay-temporary (live graphs, logits)"),
)
MIB = float(1 << 20)


def measured_peaks(segments: Iterable[MeasuredSegment]) -> dict[str, int]:
    """Measured peak total per event label; an event's `... backward` segment counts towards the event."""
    out: dict[str, int] = {}
    for seg in segments:
        label = seg.label.removesuffix(" backward")
        out[label] = max(out.get(label, 0), seg.peak.total)
    return out


def plot_ledger(
    ledger: Ledger,
    *,
    measured: Iterable[MeasuredSegment] | Mapping[str, int] | None = None,
    limit: int | None = None,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Stacked predicted bytes per ledger row (MiB); `measured` adds dots, `limit` a horizontal line."""
    plt = pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(min(16.0, 6.5 + 0.18 * len(ledger.rows)), 4.0))
    xs = list(range(len(ledger.rows)))
    bottom = [0.0] * len(xs)
    for cls, colour, label in STACK:
        heights = [r.bytes.get(cls) / MIB for r in ledger.rows]
        ax.bar(xs, heights, bottom=bottom, color=colour, width=0.85, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    peak = ledger.peak_step
    ax.annotate(
        f"predicted peak {ledger.peak.total / MIB:.1f} MiB",
        (peak, ledger.peak.total / MIB), xytext=(0, 12), textcoords="offset points", ha="center",
        fontsize=8, arrowprops={"arrowstyle": "->", "lw": 0.8},
    )  # fmt: skip
    if measured is not None:
        peaks = dict(measured) if isinstance(measured, Mapping) else measured_peaks(measured)
        pts = [(i, peaks[r.label] / MIB) for i, r in enumerate(ledger.rows) if r.label in peaks]
        if pts:
            ax.plot(*zip(*pts), "k.", ms=6, label="measured peak of the event")
    if limit is not None:
        ax.axhline(limit / MIB, color="crimson", ls="--", lw=1.0, label=f"limit {limit / MIB:.0f} MiB")
    step = max(1, len(xs) // 25)
    ax.set_xticks(xs[::step], [ledger.rows[i].label for i in xs[::step]], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("MiB")
    ax.set_ylim(0, max(bottom, default=1.0) * 1.18)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title or f"memory ledger: {len(xs)} events, peak at {ledger.rows[peak].label}", fontsize=10)
    ax.figure.tight_layout()
    return ax
