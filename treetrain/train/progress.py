"""The progress bar's fields: what an update did, without printing zeros for what was not measured.

Memory is measured only every `measure_memory_every`-th update (tracking slows replay), and an update whose
every group was dropped (all rewards equal, or failed) trains nothing. A bar that printed `peak=0 B` or
`tok_s=0` for those would read as a measurement. Instead it keeps the last measured peak, says which update
it came from, and says when an update trained nothing.

Example:
    >>> from treetrain.train.metrics import UpdateMetrics
    >>> def row(update, peak, dropped=0):
    ...     return UpdateMetrics(update=update, version=update, reward_mean=0.5, reward_std=0.5,
    ...         trajectories=8, groups=2, groups_dropped=dropped, loss=0.1, pg=0.1, kl=0.0, entropy=0.0,
    ...         clipped=0.0, mode="tree", contract="exact", graph_tokens=100, nograd_tokens=50,
    ...         flat_token_cost=900, token_cost=350, rollout_seconds=1.0, train_seconds=2.0,
    ...         peak_bytes=peak, predicted_peak_bytes=peak or 0)
    >>> bar = Progress()
    >>> bar.fields(row(0, None))["peak"]
    'not measured yet'
    >>> bar.fields(row(1, 3 * 2**20))
    {'reward': '0.50', 'tok_s': '75', 'saved': '61%', 'peak': '3.0 MiB'}
    >>> bar.fields(row(2, None, dropped=2))
    {'reward': '0.50', 'update': 'no step: all 2 groups dropped', 'peak': '3.0 MiB (update 1)'}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from treetrain.bytesize import format_bytes
from treetrain.train.metrics import UpdateMetrics


@dataclass
class Progress:
    """Turns each update's metrics row into progress-bar fields, remembering the last measured peak."""

    last_peak: tuple[int, int] | None = None
    """(update, bytes) of the most recent update whose replay memory was measured."""

    @staticmethod
    def after(rows: Sequence[UpdateMetrics]) -> Progress:
        """The state after `rows` (a resumed run keeps showing the peak measured before it stopped)."""
        measured = [(r.update, r.peak_bytes) for r in rows if r.peak_bytes is not None]
        return Progress(measured[-1] if measured else None)

    def fields(self, row: UpdateMetrics) -> dict[str, str]:
        """The bar's fields for `row`: tok_s and saved only when the update trained, the peak always labelled."""
        out = {"reward": f"{row.reward_mean:.2f}"}
        if row.groups and row.groups_dropped >= row.groups:
            out["update"] = f"no step: all {row.groups} groups dropped"
        else:
            out["tok_s"] = f"{row.tokens_per_second:.0f}"
            out["saved"] = f"{100 * row.tokens_saved:.0f}%"
        if row.sampler_logprob_gap_mean is not None:  # mean / max |trainer - sampler| logprob
            out["gap"] = f"{row.sampler_logprob_gap_mean:.2g}/{row.sampler_logprob_gap_max:.2g}"
        if row.staleness_max:  # mean / max version lag of the trained tokens (rollout.max_staleness >= 1)
            out["lag"] = f"{row.staleness_mean:.2f}/{row.staleness_max}"
        if row.peak_bytes is not None:
            self.last_peak = (row.update, row.peak_bytes)
            out["peak"] = format_bytes(row.peak_bytes)
        elif self.last_peak is not None:
            update, peak = self.last_peak
            out["peak"] = f"{format_bytes(peak)} (update {update})"
        else:
            out["peak"] = "not measured yet"
        return out


def hide_library_bars() -> None:
    """Turn off the progress bars of transformers and huggingface_hub (transformers draws one while it loads
    weights), for `--no-progress`: no bar at all on stderr, so a log holds only lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # also huggingface_hub's
