"""The progress bar's fields: what an update did, without printing zeros for what was not measured.

Memory is measured only every `measure_memory_every`-th update (tracking slows replay), and an update whose
every group was dropped (all rewards equal, or failed) trains nothing. A bar that printed `peak=0 B` or
`tok_s=0` for those would read as a measurement. Instead it keeps the last measured peak, says which update
it came from, and says when an update trained nothing.

Example:
    >>> from treetrain.train.metrics import EvalMetrics, UpdateMetrics
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

Without the bar (`--no-progress`, a batch job's log) each update is one line instead, with the peak only
when this update measured it:

    >>> Progress().line(row(1, 3 * 2**20), total=60)
    'update 1 (2/60): reward 0.500 (std 0.500), loss 0.1, tokens 150 (saved 61% of flat), rollout 1.0s, train 2.0s, peak 3.0 MiB'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from treetrain.bytesize import format_bytes
from treetrain.rollout.fanout import FanOut
from treetrain.train.metrics import EvalMetrics, UpdateMetrics


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

    @staticmethod
    def line(row: UpdateMetrics, total: int) -> str:
        """One log line for `row`: the update (its index, as metrics.jsonl and the warnings name it, and how
        many of `total` are done), reward, loss, tokens replayed,
        rollout and train seconds, the version lag when there is one, and the peak when it was measured."""
        parts = [f"reward {row.reward_mean:.3f} (std {row.reward_std:.3f})"]
        if row.groups and row.groups_dropped >= row.groups:
            parts.append(f"no step: all {row.groups} groups dropped")
        else:
            tokens = row.graph_tokens + row.nograd_tokens
            parts += [
                f"loss {row.loss:.4g}",
                f"tokens {tokens} (saved {100 * row.tokens_saved:.0f}% of flat)",
            ]
        parts += [f"rollout {row.rollout_seconds:.1f}s", f"train {row.train_seconds:.1f}s"]
        if row.staleness_max:
            parts.append(f"lag {row.staleness_mean:.2f} (max {row.staleness_max})")
        if row.peak_bytes is not None:
            parts.append(f"peak {format_bytes(row.peak_bytes)}")
        return f"update {row.update} ({row.update + 1}/{total}): " + ", ".join(parts)


def sampling_phase(done: int, tasks: int, fanout: FanOut) -> str:
    """What the bar says while a rollout grows: episodes finished of the `tasks` trees' total (exact when
    only the root branches; otherwise the most they can hold).

    >>> sampling_phase(12, 4, FanOut(root=8)), sampling_phase(3, 2, FanOut(root=2, after_tool_result=2))
    ('sampling 12/32 episodes', 'sampling 3 episodes (at most 8)')
    """
    most = tasks * fanout.max_leaves
    if fanout.max_leaves == fanout.root:
        return f"sampling {done}/{most} episodes"
    return f"sampling {done} episodes (at most {most})"


def eval_line(row: EvalMetrics, source: str) -> str:
    """The log line of a held-out evaluation; pass@k only when k > 1 (with one sample it is pass@1 again).

    >>> row = EvalMetrics(update=2, version=2, tasks=16, samples=1, pass_at_1=0.5, pass_at_k=0.5,
    ...     reward_mean=0.625)
    >>> eval_line(row, "seeds training never draws")
    'eval after 2 updates: pass@1 0.500, mean reward 0.625 over 16 held-out tasks (seeds training never draws)'
    >>> from dataclasses import replace
    >>> eval_line(replace(row, samples=4, pass_at_k=0.75), "x")
    'eval after 2 updates: pass@1 0.500, pass@4 0.750, mean reward 0.625 over 16 held-out tasks (x)'
    """
    at_k = f"pass@{row.samples} {row.pass_at_k:.3f}, " if row.samples > 1 else ""
    return (
        f"eval after {row.update} updates: pass@1 {row.pass_at_1:.3f}, {at_k}mean reward {row.reward_mean:.3f} "
        f"over {row.tasks} held-out tasks ({source})"
    )


class Phases:
    """The bar's description while an update works, so the first update (a minute on a CPU: sampling, then
    calibrating and planning) never sits at `0/N` without a word: `train (sampling 12/32 episodes)`, then
    `train (training on 32 episodes)`; calibration draws its own bar below it. Nothing is drawn when
    the bar is disabled."""

    def __init__(self, bar: tqdm, fanout: FanOut, tasks: int) -> None:
        self.bar, self.fanout, self.tasks = bar, fanout, tasks
        self.episodes = 0

    def show(self, doing: str | None) -> None:
        """Say what the update is `doing` (None: nothing; the bar's plain name)."""
        if not self.bar.disable:
            self.bar.set_description_str("train" if doing is None else f"train ({doing})")

    def sampling(self) -> None:
        self.episodes = 0
        self.show(sampling_phase(0, self.tasks, self.fanout))

    def episode(self) -> None:
        """One more trajectory finished (called by the rollout, in the trainer's thread)."""
        self.episodes += 1
        self.show(sampling_phase(self.episodes, self.tasks, self.fanout))


def hide_library_bars() -> None:
    """Turn off the progress bars of transformers and huggingface_hub (transformers draws one while it loads
    weights), of memory calibration and of the inference engine's weight loading, for `--no-progress`: no bar
    at all on stderr, so a log holds only lines."""
    import os

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # also huggingface_hub's
    os.environ["TQDM_DISABLE"] = "1"  # tqdm's own switch: calibration and the engines' loading honour it too
