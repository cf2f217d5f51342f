"""The end-of-run summary: reward curve (PNG and text sparkline), memory against the ledger, tokens saved.

Example:
    >>> sparkline([0.0, 0.25, 0.5, 1.0])
    '▁▃▅█'
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from treetrain.bytesize import format_bytes
from treetrain.io import atomic_write_bytes
from treetrain.train.metrics import EvalMetrics, UpdateMetrics

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """Values as block characters, averaged into at most `width` buckets."""
    if not values:
        return ""
    if len(values) > width:
        step = len(values) / width
        values = [
            sum(values[int(i * step) : max(int((i + 1) * step), int(i * step) + 1)])
            / len(values[int(i * step) : max(int((i + 1) * step), int(i * step) + 1)])
            for i in range(width)
        ]
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(_BARS[min(len(_BARS) - 1, int((v - lo) / span * (len(_BARS) - 1) + 0.5))] for v in values)


@dataclass(frozen=True)
class RunSummary:
    """Headline numbers of a run, computed from its metrics rows."""

    updates: int
    first_reward: float
    """Mean reward of the first `window` updates."""
    last_reward: float
    """Mean reward of the last `window` updates."""
    window: int
    peak_bytes: int | None
    """Largest measured peak (None: no update was measured)."""
    predicted_peak_bytes: int
    tokens_saved: float
    """1 - (token cost spent) / (token cost flat would have spent), over the whole run."""
    train_seconds: float
    rollout_seconds: float

    @staticmethod
    def of(rows: Sequence[UpdateMetrics], window: int = 10) -> RunSummary:
        """Peak memory compares the measured and predicted peaks of the updates that were measured."""
        if not rows:
            raise ValueError("no metrics to summarize")
        w = max(1, min(window, len(rows) // 2 or 1))
        rewards = [r.reward_mean for r in rows]
        flat = sum(r.flat_token_cost for r in rows)
        spent = sum(r.token_cost for r in rows)
        return RunSummary(
            updates=len(rows),
            first_reward=sum(rewards[:w]) / w,
            last_reward=sum(rewards[-w:]) / w,
            window=w,
            peak_bytes=max((r.peak_bytes for r in rows if r.peak_bytes is not None), default=None),
            predicted_peak_bytes=max(
                (r.predicted_peak_bytes for r in rows if r.peak_bytes is not None), default=0
            ),
            tokens_saved=1.0 - spent / flat if flat else 0.0,
            train_seconds=sum(r.train_seconds for r in rows),
            rollout_seconds=sum(r.rollout_seconds for r in rows),
        )

    def text(self, rows: Sequence[UpdateMetrics]) -> str:
        lines = [
            f"updates            {self.updates}",
            f"reward             {sparkline([r.reward_mean for r in rows])}",
            f"mean reward        first {self.window}: {self.first_reward:.3f}   last {self.window}: {self.last_reward:.3f}",
            f"tokens saved       {100 * self.tokens_saved:.1f}% of flat's token cost",
            f"time               rollout {self.rollout_seconds:.0f}s, train {self.train_seconds:.0f}s",
        ]
        if self.peak_bytes is not None:
            ratio = self.peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else float("nan")
            lines.append(
                f"peak memory        measured {format_bytes(self.peak_bytes)}, ledger predicted "
                f"{format_bytes(self.predicted_peak_bytes)} (measured/predicted {ratio:.2f}; "
                "live tensor bytes beyond parameters and optimizer state)"
            )
        return "\n".join(lines)


SHOWN = (
    "metrics.jsonl", "reward.png", "summary.txt", "rollouts/", "eval/", "final/", "final-merged/",
    "checkpoints/", "env-errors/", "tensorboard/",
)  # fmt: skip
"""What the end of a run names in its run directory, in this order, when it is there."""


def run_contents(run_dir: Path) -> str:
    """The entries of `SHOWN` that `run_dir` holds (`eval/` only when the run evaluated, `final-merged/` only
    for a merged LoRA export): what the last line of `treetrain train` lists.

    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> (run / "final").mkdir(), (run / "eval").mkdir(), (run / "metrics.jsonl").touch()
    (None, None, None)
    >>> run_contents(run)
    'metrics.jsonl, eval/, final/'
    """
    found = []
    for name in SHOWN:
        path = run_dir / name.rstrip("/")
        if path.is_dir() if name.endswith("/") else path.is_file():
            found.append(name)
    return ", ".join(found)


def plot_rewards(
    rows: Sequence[UpdateMetrics],
    path: str | Path,
    run_name: str | None = None,
    evals: Sequence[EvalMetrics] = (),
) -> Path | None:
    """Reward curve (per update and a 10-update moving mean) as a PNG; None when matplotlib is missing.

    Held-out evaluations (`evals`) are drawn on the same axes, their pass@1 and mean reward against the
    updates completed when each ran, so the training curve and the held-out one read side by side.

    The title names the run (default: the directory the PNG is written to, the run directory), so a copied
    or attached picture still says which run it shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    xs = [r.update for r in rows]
    ys = [r.reward_mean for r in rows]
    avg = [sum(ys[max(0, i - 9) : i + 1]) / len(ys[max(0, i - 9) : i + 1]) for i in range(len(ys))]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(xs, ys, ".", alpha=0.5, label="mean reward per update")
    ax.plot(xs, avg, "-", label="10-update moving mean")
    if evals:
        ex = [e.update for e in evals]
        ax.plot(ex, [e.pass_at_1 for e in evals], "s-", label="held-out pass@1")
        ax.plot(ex, [e.reward_mean for e in evals], "^--", label="held-out mean reward")
        ys = [*ys, *(e.reward_mean for e in evals)]
    ax.set_xlabel("update")
    ax.set_ylabel("reward")
    if ys and min(ys) >= 0 and max(ys) <= 1:  # rewards in [0, 1]: show the whole range
        ax.set_ylim(-0.05, 1.05)
    run = run_name if run_name is not None else (Path(path).resolve().parent.name or str(path))
    ax.set_title(f"{run}: reward over {len(rows)} updates", fontsize=10)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(out, png.getvalue())  # refuses a link or a special file at `out`
    return out
