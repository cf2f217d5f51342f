"""Per-update metrics: one typed row per update, appended to `metrics.jsonl` (and TensorBoard when installed).

The JSONL file is the run's record: the summary, the notebooks and a resumed run all read it back. Held-out
evaluations (`eval.every`) write their own typed rows, `EvalMetrics`, to the same file, marked
`"kind": "eval"`; `read_metrics` reads the update rows and `read_evals` the evaluation rows.

Example:
    >>> row = UpdateMetrics(update=0, version=1, reward_mean=0.5, reward_std=0.5, trajectories=8,
    ...                     groups=1, groups_dropped=0, loss=0.1, pg=0.1, kl=0.0, entropy=0.0, clipped=0.0,
    ...                     mode="tree", contract="exact", graph_tokens=100, nograd_tokens=50,
    ...                     flat_token_cost=900, token_cost=350, rollout_seconds=1.0, train_seconds=2.0,
    ...                     peak_bytes=1000, predicted_peak_bytes=1100)
    >>> round(row.tokens_saved, 3)
    0.611
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from treetrain.diskfull import naming_full_disk
from treetrain.errors import TreetrainError
from treetrain.io import atomic_write_text
from treetrain.rollout.sources.staleness import Dropped, Staleness
from treetrain.runfs import open_file
from treetrain.tree.stats import tree_stats
from treetrain.tree.trajectory_tree import TrajectoryTree

if TYPE_CHECKING:
    from treetrain.train.config import TrainConfig
    from treetrain.update.run import UpdateOutcome

log = logging.getLogger(__name__)


class Rollout(Protocol):
    """What one update's rollout produced (the trainer's tree sources return it)."""

    @property
    def trees(self) -> tuple[TrajectoryTree, ...]: ...
    @property
    def seconds(self) -> float: ...
    @property
    def failed_episodes(self) -> int: ...
    @property
    def step_timeouts(self) -> int: ...
    @property
    def interrupted(self) -> int: ...
    @property
    def staleness(self) -> Staleness: ...
    @property
    def stale(self) -> Dropped: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def sampler_idle(self) -> float: ...
    @property
    def trainer_idle(self) -> float: ...
    @property
    def servers_lost(self) -> int: ...
    @property
    def servers(self) -> tuple[tuple[str, int, int, float], ...]: ...
    @property
    def weight_sync_bytes(self) -> int: ...
    @property
    def weight_sync_seconds(self) -> float: ...
    @property
    def weight_publish_seconds(self) -> float: ...


@dataclass(frozen=True)
class UpdateMetrics:
    """What one update did."""

    update: int
    """Index of the update (0-based)."""
    version: int
    """Model version after this update's optimizer step."""
    reward_mean: float
    """Mean reward of every trajectory sampled for this update (dropped groups included)."""
    reward_std: float
    """Their standard deviation."""
    trajectories: int
    """Trajectories sampled."""
    groups: int
    """Advantage groups (trees) sampled, those of failed tasks (`failed_episodes`) included."""
    groups_dropped: int
    """Groups left out of the step (a failed task's, zero reward variance, or incomplete)."""
    loss: float
    """The normalized loss this rank backpropagated."""
    pg: float
    """Its policy-gradient part."""
    kl: float
    """Coefficient-weighted KL to the reference (before kl_coef)."""
    entropy: float
    """Coefficient-weighted entropy (before entropy_coef)."""
    clipped: float
    """Weighted fraction of token terms whose ratio was clipped."""
    mode: str
    """'tree' or 'flat', as planned ('none' when no group was left)."""
    contract: str
    """'exact' or 'response_only'."""
    graph_tokens: int
    """Tokens forwarded under autograd on this rank."""
    nograd_tokens: int
    """Tokens forwarded without a graph (scoring, reference, recompute) on this rank."""
    flat_token_cost: int
    """Token-ceiling cost the flat reference would have spent on the same update."""
    token_cost: int
    """Token-ceiling cost actually spent (3 per graph token, 1 per no-grad token)."""
    rollout_seconds: float
    """Wall time of sampling (0 for recorded trees)."""
    train_seconds: float
    """Wall time of planning, replay and the optimizer step."""
    peak_bytes: int | None
    """Measured peak of live tensor bytes during replay, run-persistent bytes left out (None, `null` in
    metrics.jsonl: this update was not measured, see `measure_memory_every`)."""
    predicted_peak_bytes: int
    """The ledger's prediction of the same quantity (0 when this update was not measured)."""
    replay_tokens_max: int = 0
    """Replay tokens of the busiest rank in this update's placement (all ranks together: the total)."""
    replay_tokens_mean: float = 0.0
    """Mean replay tokens per rank in the same placement."""
    failed_episodes: int = 0
    """Tasks lost to a failure of their episode (environment code raising in reset, step, fork or a rubric,
    a dead worker, a call past its deadline, a prompt over the episode budget, a template error): each ends its tree at the failed episode, and its group is dropped whole, so it is counted in
    `groups` and `groups_dropped` but not in `trajectories` (tracebacks: `env-errors/update-XXXXX.log`)."""
    step_timeouts: int = 0
    """Environment steps of this update that missed `rollout.episode.step_timeout_s`, all ranks: each became
    a timeout observation and its episode went on (warned once per update when not 0)."""
    samples_interrupted: int = 0
    """Samples of this update's rollout stopped mid-turn when newer weights arrived and resubmitted with the
    tokens they had drawn, all ranks (`rollout.max_staleness` >= 1; their tokens span versions)."""
    sampler_logprob_gap_mean: float | None = None
    """Mean |logp_trainer - logp_sampler| over the update's policy tokens, all ranks (trainer: the scoring
    pass's old logprob; sampler: the one recorded at rollout). None (`null`) when no token has a sampler
    logprob, or without a scoring pass (`loss.ratio_source='sampler'`). Tree mode leaves out branches it
    skips as inert (`replay.skip_inert`). Meaningful only for sampling at temperature 1 and top_p 1
    (otherwise it measures the tempering; docs/training.md)."""
    sampler_logprob_gap_max: float | None = None
    """The largest such gap of the update (None when the mean is)."""
    sampler_corrected_fraction: float | None = None
    """Fraction of those tokens whose weight `loss.sampler_correction` changed: truncated to the cap
    (`token_truncate`), or in a dropped trajectory (`sequence_mask`); None without a correction."""
    staleness_min: int | None = None
    """Smallest version lag of the policy tokens this update trained on, per trajectory: the trainer's version
    before the step minus the version that sampled the token (`treetrain.rollout.sources.staleness`); 0 in a synchronous
    run. None when no trained token records its version (recorded trees without versions)."""
    staleness_mean: float | None = None
    """Their mean lag."""
    staleness_max: int | None = None
    """Their largest lag (at most `rollout.max_staleness`)."""
    sampler_gap_by_lag: tuple[tuple[int, float, float, int], ...] = ()
    """The sampler gap split by version lag: (lag, mean, max, tokens) per lag of the scored policy tokens,
    lag ascending (tokens that record no version left out). With `rollout.max_staleness` >= 1 the lag-0
    row is the engine's numerical mismatch and the others add the staleness."""
    stale_tokens_dropped: int = 0
    """Policy tokens of groups dropped because a token was over `rollout.max_staleness` (those groups are
    counted in `groups_dropped`)."""
    queue_depth: int = 0
    """Later updates whose rollouts were finished and waiting when this update took its trees."""
    sampler_idle_seconds: float = 0.0
    """Seconds the sampler waited, before this update's rollout, for the trainer to come within the bound."""
    trainer_idle_seconds: float = 0.0
    """Seconds the trainer waited for this update's trees (the whole rollout in a synchronous run)."""
    servers_lost: int = 0
    """Inference servers lost during this update's rollout (each named in a warning line; their samples
    went on at the other servers)."""
    context_bytes: int = 0
    """Bytes this rank put into its context group's collectives in this update (the partial attention
    states gathered forward, the output gradients reduced backward; 0 without a context group,
    `distributed.context_parallel`)."""
    context_bytes_predicted: int = 0
    """What the per-rank ledger predicted for `context_bytes`, over this rank's share of the update as it was
    laid out (0 without a context group)."""
    servers: tuple[tuple[str, int, int, float], ...] = ()
    """Per inference server, `(url, requests, samples, mean seconds a request waited in its queue)`: every
    trainer rank's requests, the queue time from the server's own metrics (every client's requests)."""
    weight_sync_bytes: int = 0
    """Bytes the weight syncs for this update's rollout sent to the inference engines, over all ranks (a
    shared fleet of servers: the files rank 0 wrote once; an engine per rank: each rank's copy; 0 for an
    engine that samples from the trained model itself)."""
    weight_sync_seconds: float = 0.0
    """Seconds those syncs took on rank 0."""
    weight_publish_seconds: float = 0.0
    """Seconds rank 0's training thread spent handing the weights of the previous step to the sampler (an
    asynchronous run: the copy into the sampler's shadow, or the files every server loads; 0 otherwise)."""

    @property
    def replay_imbalance(self) -> float:
        """Cross-rank balance of the update: max over mean replay tokens (1.0 on one rank, or when perfect)."""
        return self.replay_tokens_max / self.replay_tokens_mean if self.replay_tokens_mean else 1.0

    @property
    def tokens_saved(self) -> float:
        """Fraction of flat's token cost this update did not spend."""
        return 1.0 - self.token_cost / self.flat_token_cost if self.flat_token_cost else 0.0

    @property
    def tokens_per_second(self) -> float:
        return (
            (self.graph_tokens + self.nograd_tokens) / self.train_seconds if self.train_seconds > 0 else 0.0
        )

    @staticmethod
    def of(
        update: int,
        rollout: Rollout,
        outcome: UpdateOutcome,
        cfg: TrainConfig,
        *,
        trained_at: int,
        train_seconds: float,
        data_groups: int,
    ) -> UpdateMetrics:
        """The row of update `update`: from its rollout and what `run_update` reported (`trained_at` is the
        model version the update trained, `data_groups` the rank groups the flat cost is shared by: the world over the context group's size). The one
        place a field is filled in: a new metric is a field here and the report it comes from."""
        from treetrain.replay import ReplayReport  # the replay engine loads torch; reading rows must not

        plan, result = outcome.plan, outcome.report
        report = result.local if result is not None else ReplayReport()
        rewards = [r.reward for t in rollout.trees for r in t.records]
        kept = [t for g in outcome.groups for t in g.trees]
        scoring = cfg.loss.ratio_source == "scoring"
        flat_cost = sum(tree_stats(t).cost_flat(scoring=scoring) for t in kept)
        balance = result.rank_tokens if result is not None else ()
        gap = result.sampler_gap if result is not None else None
        dropped = len(result.dropped) if result is not None else 0
        return UpdateMetrics(
            update=update,
            version=result.version if result is not None else trained_at,
            reward_mean=float(np.mean(rewards)) if rewards else 0.0,
            reward_std=float(np.std(rewards)) if rewards else 0.0,
            trajectories=len(rewards),
            groups=len(rollout.trees) + rollout.failed_episodes + rollout.stale.groups,
            groups_dropped=rollout.failed_episodes + rollout.stale.groups + outcome.zero_variance + dropped,
            loss=report.loss,
            pg=report.pg,
            kl=report.kl,
            entropy=report.entropy,
            clipped=report.clipped,
            mode=plan.mode if plan else "none",
            contract=cfg.replay.contract,
            failed_episodes=rollout.failed_episodes,
            step_timeouts=rollout.step_timeouts,
            samples_interrupted=rollout.interrupted,
            graph_tokens=report.graph_tokens,
            nograd_tokens=report.nograd_tokens,
            flat_token_cost=flat_cost // data_groups,
            token_cost=report.token_cost,
            rollout_seconds=rollout.seconds,
            train_seconds=train_seconds,
            peak_bytes=report.measured_peak.dynamic if report.measured_peak else None,
            predicted_peak_bytes=int(plan.ledger.peak.dynamic) if plan and report.measured_peak else 0,
            replay_tokens_max=max(balance, default=0),
            replay_tokens_mean=sum(balance) / len(balance) if balance else 0.0,
            sampler_logprob_gap_mean=gap.mean if gap is not None else None,
            sampler_logprob_gap_max=gap.max if gap is not None else None,
            sampler_corrected_fraction=gap.corrected_fraction
            if gap is not None and cfg.loss.corrects_sampler
            else None,
            sampler_gap_by_lag=gap.by_lag(trained_at) if gap is not None else (),
            staleness_min=rollout.staleness.least,
            staleness_mean=rollout.staleness.mean,
            staleness_max=rollout.staleness.most,
            stale_tokens_dropped=rollout.stale.tokens,
            queue_depth=rollout.queue_depth,
            sampler_idle_seconds=rollout.sampler_idle,
            trainer_idle_seconds=rollout.trainer_idle,
            servers_lost=rollout.servers_lost,
            context_bytes=report.crossed_bytes,
            context_bytes_predicted=outcome.predicted_context_bytes,
            servers=rollout.servers,
            weight_sync_bytes=rollout.weight_sync_bytes,
            weight_sync_seconds=rollout.weight_sync_seconds,
            weight_publish_seconds=rollout.weight_publish_seconds,
        )

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_saved"] = self.tokens_saved
        d["tokens_per_second"] = self.tokens_per_second
        d["replay_imbalance"] = self.replay_imbalance
        return d


@dataclass(frozen=True)
class EvalMetrics:
    """One held-out evaluation (`treetrain.train.evaluation`): how the policy did on tasks it never trains on."""

    update: int
    """Updates completed when it ran (0: before the first)."""
    version: int
    """Model version evaluated."""
    tasks: int
    """Held-out tasks scored (tasks lost to environment failures are left out, see `failed_tasks`)."""
    samples: int
    """Samples per task (k of pass@k)."""
    pass_at_1: float
    """Mean over tasks of the fraction of samples that pass (reward >= `eval.pass_threshold`)."""
    pass_at_k: float
    """Mean over tasks of the unbiased pass@k estimate (Chen et al. 2021) with k = `samples`."""
    reward_mean: float
    """Mean reward over every sample of every task."""
    failed_tasks: int = 0
    """Tasks whose episode failed in environment code (not scored)."""
    seconds: float = 0.0
    """Wall time of the evaluation."""
    greedy: bool = True
    """Greedy decoding (else the rollout's sampling settings)."""
    kind: str = "eval"
    """Always 'eval': tells these rows from update rows in metrics.jsonl."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class MetricsError(TreetrainError, ValueError):
    """A metrics file that cannot be read; the message names the file and line."""


def read_metrics(path: str | Path) -> list[UpdateMetrics]:
    """Rows of a metrics.jsonl file (derived columns are ignored).

    A last line cut short by a crash mid-append is skipped with a warning; a bad line elsewhere is an error.
    """
    names = {f.name for f in fields(UpdateMetrics)}
    try:
        with open_file(None, path, "rb") as f:  # never through a link, never a FIFO
            lines = f.read().decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise MetricsError(f"{path}: not UTF-8 text (a bad byte at offset {exc.start})") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if isinstance(obj, dict) and obj.get("kind") == "eval":
                continue  # an evaluation row (`read_evals`)
            rows.append(_row(obj, names))
        except (ValueError, TypeError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            if number == len(lines):
                log.warning("%s:%d: skipping a partial last line (%s)", path, number, exc)
                continue
            raise MetricsError(
                f"{path}:{number}: not a metrics row: {type(exc).__name__}: {' '.join(str(exc).split())}"[
                    :300
                ]
            ) from None
    return rows


def read_evals(path: str | Path) -> list[EvalMetrics]:
    """The evaluation rows of a metrics.jsonl file (`"kind": "eval"`), in the order they were written; a
    line that is not one is skipped (`read_metrics` is the reader that refuses bad lines)."""
    names = {f.name for f in fields(EvalMetrics)}
    try:
        with open_file(None, path, "rb") as f:
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and obj.get("kind") == "eval":
            try:
                rows.append(EvalMetrics(**{k: v for k, v in obj.items() if k in names}))
            except TypeError as exc:
                raise MetricsError(f"{path}: not an evaluation row: {exc}") from None
    return rows


def _row(obj: object, names: set[str]) -> UpdateMetrics:
    """One row from a decoded line; a line that is not an object, or whose update is not a whole number, is
    a TypeError (resuming compares and truncates by update)."""
    if not isinstance(obj, dict):
        raise TypeError(f"a JSON {type(obj).__name__}, not an object")
    update = obj.get("update")
    if isinstance(update, bool) or not isinstance(update, int):
        raise TypeError(f"'update' is {update!r:.40}, not a whole number")
    return UpdateMetrics(**{k: v for k, v in obj.items() if k in names})


class MetricsWriter:
    """Appends rows to `<run_dir>/metrics.jsonl`; mirrors scalars to TensorBoard if it is installed."""

    def __init__(self, run_dir: str | Path, *, truncate_after: int | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_after is not None and os.path.lexists(self.path):
            kept: list[UpdateMetrics | EvalMetrics] = [
                r for r in read_metrics(self.path) if r.update < truncate_after
            ]
            kept += [r for r in read_evals(self.path) if r.update <= truncate_after]
            # update row i ends with i + 1 updates done; the evaluation after u updates follows row u - 1
            kept.sort(
                key=lambda r: (r.update + isinstance(r, UpdateMetrics), not isinstance(r, UpdateMetrics))
            )
            atomic_write_text(self.path, "".join(json.dumps(r.as_dict()) + "\n" for r in kept))
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        except ImportError:
            self._tb = None

    def write(self, row: UpdateMetrics) -> None:
        line = (json.dumps(row.as_dict()) + "\n").encode()
        # an append's OSError names no file; a planted link is refused, not followed
        with naming_full_disk(self.path.parent, len(line)), open_file(self.path.parent, self.path, "ab") as f:
            f.write(line)
            f.flush()
        if self._tb is not None:
            for key, value in row.as_dict().items():
                if isinstance(value, int | float) and key != "update":
                    self._tb.add_scalar(key, value, row.update)

    def write_eval(self, row: EvalMetrics) -> None:
        """Append an evaluation row (TensorBoard: `eval/<name>` against the updates completed)."""
        line = (json.dumps(row.as_dict()) + "\n").encode()
        with naming_full_disk(self.path.parent, len(line)), open_file(self.path.parent, self.path, "ab") as f:
            f.write(line)
            f.flush()
        if self._tb is not None:
            for key in ("pass_at_1", "pass_at_k", "reward_mean"):
                self._tb.add_scalar(f"eval/{key}", getattr(row, key), row.update)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
