"""The recorded source: tree files consumed in order instead of rollouts (`rollout.trees`).

Every tree is checked before any model loads: its token ids against the model's vocabulary, its calls
against the model's context, its sampler logprobs and sampling settings against what the loss will do with
them (`check_*`). Trees are untrusted input, read with the tree format's own limits.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treetrain.errors import ConfigError
from treetrain.loss.loss_config import LossConfig
from treetrain.rollout.sampling import Sampling
from treetrain.rollout.sources.produced import Produced
from treetrain.rollout.sources.run_settings import RunSettings
from treetrain.tree import TrajectoryTree
from treetrain.tree.checks import check_distinct, check_vocabulary
from treetrain.tree.format import load_trees
from treetrain.tree.unpack import short_repr

if TYPE_CHECKING:
    from treetrain.rollout.engines.generation import GenerationEngine

log = logging.getLogger(__name__)


def check_lengths(trees: Sequence[TrajectoryTree], context: int | None, where: str) -> None:
    """Refuse recorded trees with a call longer than the model's context (naming both numbers)."""
    if context is None:
        return
    for tree in trees:
        for record in tree.records:
            for call in record.calls:
                length = sum(call.segment_lengths)
                if length > context:
                    raise ConfigError(
                        f"{where}: trajectory {record.id!r} has a call of {length} tokens, longer than the "
                        f"model's context of {context} tokens (max_position_embeddings)"
                    )


def check_sampler_logprobs(trees: Sequence[TrajectoryTree], where: str, loss: LossConfig) -> None:
    """`loss.ratio_source='sampler'` takes the PPO ratio's old logprobs from the file, and a
    `loss.sampler_correction` its weights: refuse, before any model loads, a tree with a policy segment that
    was recorded without them (trees imported without logprobs). Nothing to check when neither is on."""
    if loss.ratio_source == "sampler":
        field, value, fix = "loss.ratio_source", "'sampler'", "ratio_source='scoring'"
    elif loss.corrects_sampler:
        field, value, fix = (
            "loss.sampler_correction",
            repr(loss.sampler_correction),
            "sampler_correction='none'",
        )
    else:
        return
    for tree in trees:
        for record in tree.records:
            if any(lp is None for call in record.calls for lp in call.logprobs):
                raise ConfigError(
                    f"{field}: {value} needs the sampler's logprobs of every policy token, but in "
                    f"{where} trajectory {short_repr(record.id, 40)} has a policy segment without them; "
                    f"record them at rollout or use {fix}"
                )


def check_sampling(trees: Sequence[TrajectoryTree], where: str, sampling: Sampling) -> None:
    """Refuse a tree that recorded other sampling settings than `rollout.sampling`: the loss scores at the
    sampling temperature, and the sampler's logprobs in the file are of the distribution it recorded, so
    training on it as configured would be off policy. A tree that recorded nothing (imported, or written
    before trees recorded it) is taken to be sampled as configured."""
    for tree in trees:
        got = tree.sampling
        if got is None or (got.temperature, got.top_p) == (sampling.temperature, sampling.top_p):
            continue
        fix = [
            f"rollout.sampling.{name}={value}"
            for name, value, want in (
                ("temperature", got.temperature, sampling.temperature),
                ("top_p", got.top_p, sampling.top_p),
            )
            if value != want
        ]
        raise ConfigError(
            f"{where}: tree {tree.id[:12]} was sampled at {got.describe()} (recorded in the file), but "
            f"rollout.sampling is temperature {sampling.temperature}, top_p {sampling.top_p}; the loss "
            f"scores at the sampling temperature, so set {' and '.join(fix)} to train on it"
        )


def glob_files(pattern: str) -> list[Path]:
    """Files matching a glob, sorted; `**` never descends a symbolic link, so a link loop cannot hang it.

    `glob.glob(recursive=True)` follows links to directories at every level (a loop is walked until path
    names get too long, exponentially often); `pathlib`'s `**` does not, so the pattern's literal leading
    directories become the root of a `Path.glob`.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); os.makedirs(f"{d}/a"); os.symlink("..", f"{d}/a/loop")
        >>> _ = open(f"{d}/a/x.msgpack", "wb").close()
        >>> [p.name for p in glob_files(f"{d}/**/*.msgpack")]
        ['x.msgpack']
    """
    parts = Path(pattern).parts
    first = next((k for k, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    root = Path(*parts[:first]) if first else Path()
    if first == len(parts):
        return [root] if os.path.lexists(root) else []
    return sorted(root.glob(str(Path(*parts[first:]))))


class RecordedSource:
    """Consumes recorded tree files in sorted order, `groups_per_update` trees per update, cycling at the end.

    Every token id must exist in the model's vocabulary: trees tokenized with another tokenizer are refused
    before training starts. With fewer trees than `groups_per_update`, each update takes all of them.
    """

    waits_for: str | None = "reading trees"
    one_sampler = False
    """Nothing samples (a run on recorded trees has no evaluation)."""

    def __init__(self, cfg: RunSettings, vocab_size: int, context: int | None = None) -> None:
        assert cfg.rollout.trees is not None
        pattern = cfg.rollout.trees
        path = Path(pattern)
        try:  # a name too long or a symlink loop
            files = sorted(path.glob("**/*.msgpack")) if path.is_dir() else glob_files(pattern)
        except OSError as exc:
            raise ConfigError(
                f"rollout.trees: cannot list {short_repr(pattern, 80)}: {exc.strerror or exc}"
            ) from None
        if not files:
            raise ConfigError(f"rollout.trees: no .msgpack files at {short_repr(pattern, 200)}")
        self.groups: list[tuple[TrajectoryTree, ...]] = []
        for f in files:
            try:
                trees = load_trees(f)
            except OSError as exc:  # a FIFO, a device, a directory named *.msgpack, a symlink loop
                raise ConfigError(f"rollout.trees: cannot read {f}: {exc.strerror or exc}") from None
            check_vocabulary([(f"rollout.trees: {f}", trees)], vocab_size)
            check_lengths(trees, context, f"rollout.trees: {f}")
            check_sampler_logprobs(trees, f"rollout.trees: {f}", cfg.loss)
            check_sampling(trees, f"rollout.trees: {f}", cfg.rollout.sampling)
            self.groups.append(trees)  # a file's trees are one group (trees/README.md)
        check_distinct([(f"rollout.trees: {f}", g) for f, g in zip(files, self.groups)])
        self.per_update = min(cfg.rollout.groups_per_update, len(self.groups))
        if self.per_update < cfg.rollout.groups_per_update:
            log.warning(
                "rollout.trees holds %d groups, fewer than rollout.groups_per_update=%d: each update takes all",
                len(self.groups),
                cfg.rollout.groups_per_update,
            )

    def trained(self, update: int, model: Any, version: int) -> None:
        """Nothing to do: recorded trees do not depend on the weights."""

    def serving(self, model: Any, version: int) -> AbstractContextManager[GenerationEngine]:
        """Never: a run on recorded trees has no engine (the config refuses `eval.every` with `rollout.trees`)."""
        raise ConfigError(
            "eval.every: a run on recorded trees (rollout.trees) has no rollout engine to sample on"
        )

    def close(self) -> None:
        """Nothing to release: the trees are in memory."""

    def produce(self, model: Any, update: int, version: int) -> Produced:
        n = len(self.groups)
        start = update * self.per_update
        if start // n != (start + self.per_update - 1) // n:
            log.info("recorded groups exhausted; starting another pass over %d groups", n)
        return Produced(tuple(self.groups[(start + i) % n] for i in range(self.per_update)), 0.0)
