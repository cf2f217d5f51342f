"""The recorded source (`rollout.trees`): a file's trees are one group, globs recurse, and a tree that
recorded its sampling must match `rollout.sampling`."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.train_cases import TINY

from treetrain.errors import ConfigError
from treetrain.rollout.sources.recorded_source import RecordedSource
from treetrain.train.config import load_config
from treetrain.update.run import advantage_groups


def _cfg(run_dir: Path, *extra: str):
    return load_config(None, [*TINY, f"run_dir={run_dir}", *extra])


def test_recorded_trees_are_trained_at_the_temperature_they_were_sampled_at(tmp_path: Path) -> None:
    """A tree that says how it was sampled must match rollout.sampling (the loss scores at its temperature);
    one that says nothing (imported, or an older file) is taken as configured."""
    from treetrain.tree import SamplingRecord, TrajectoryTree
    from treetrain.tree.format import save_trees
    from treetrain.tree.synthetic import synthetic_group

    tree = synthetic_group(prefix=6, branches=2, suffix=3, vocab=64, seed=1)
    hot = TrajectoryTree(tree.nodes, tree.records, SamplingRecord(0.7, 1.0))
    save_trees([hot], tmp_path / "hot.msgpack")
    save_trees([tree], tmp_path / "unknown.msgpack")
    for sets, refused in (
        ([], "set rollout.sampling.temperature=0.7 to train on it"),
        (
            ["rollout.sampling.top_p=0.9"],
            "set rollout.sampling.temperature=0.7 and rollout.sampling.top_p=1.0 to train on it",
        ),
        (["rollout.sampling.temperature=0.7"], None),
    ):
        cfg = _cfg(tmp_path / "run", f"rollout.trees={tmp_path / 'hot.msgpack'}", *sets)
        if refused is None:
            assert (
                RecordedSource(cfg, vocab_size=64).produce(None, 0, 0).groups[0][0].sampling == hot.sampling
            )
            continue
        with pytest.raises(ConfigError) as info:
            RecordedSource(cfg, vocab_size=64)
        message = str(info.value)
        assert message.startswith(f"rollout.trees: {tmp_path / 'hot.msgpack'}: tree {tree.id[:12]} was sampled "
                                  "at temperature 0.7, top_p 1.0 (recorded in the file)")  # fmt: skip
        assert message.endswith(refused) and "\n" not in message
    for temperature in ("0.7", "1.0"):  # nothing recorded: nothing to hold it to
        cfg = _cfg(tmp_path / "run", f"rollout.trees={tmp_path / 'unknown.msgpack'}",
                   f"rollout.sampling.temperature={temperature}")  # fmt: skip
        assert RecordedSource(cfg, vocab_size=64).produce(None, 0, 0).groups[0][0].sampling is None


def test_a_recorded_file_is_one_group_and_globs_recurse(tmp_path: Path) -> None:
    """Two trees with rewards [1, 1] and [0, 0] stored as one group have variance; apart, neither would."""
    from treetrain.tree.format import save_trees
    from treetrain.tree.synthetic import synthetic_group

    ones = synthetic_group(prefix=6, branches=2, suffix=3, vocab=64, seed=1, rewards=[1.0, 1.0])
    zeros = synthetic_group(prefix=6, branches=2, suffix=3, vocab=64, seed=2, rewards=[0.0, 0.0])
    (tmp_path / "a" / "b").mkdir(parents=True)
    save_trees([ones, zeros], tmp_path / "a" / "b" / "group.msgpack")
    cfg = _cfg(tmp_path / "run", f"rollout.trees={tmp_path}/**/*.msgpack")
    produced = RecordedSource(cfg, vocab_size=64).produce(None, 0, 0)
    assert [len(g) for g in produced.groups] == [2]
    groups, dropped = advantage_groups(produced.groups, cfg.advantages)
    assert dropped == 0 and len(groups) == 1 and len(groups[0].trees) == 2
