"""`distributed.context_parallel` is checked before any process group or model exists: a bad value, the
one-process backend, or a C that does not divide the world each get one clear error. A group's replay
first has its ranks agree on what they replay."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from support.dist_cases import VOCAB, groups

from treetrain.distributed.context_groups import check_context_size, context_exchange
from treetrain.errors import ConfigError
from treetrain.loss.loss_config import LossConfig
from treetrain.models.context_exchange import ContextExchange, GroupMismatchError
from treetrain.models.presets import tiny_model
from treetrain.replay import ReplayConfig, TreeReplay, UpdateBatch
from treetrain.replay.resident import ResidentIdentity, ResidentStore
from treetrain.train.config import load_config


def test_default_is_one_group_per_rank() -> None:
    cfg = load_config(None)
    assert cfg.distributed.context_parallel == 1
    assert context_exchange(rank=0, world_size=1, size=1) is None  # no group, no collective


@pytest.mark.parametrize("value", ["0", "-2", "true", "1.5", "5000"])
def test_bad_values_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="context_parallel"):
        load_config(None, ["distributed.backend=deepspeed", f"distributed.context_parallel={value}"])


def test_torch_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"need distributed\.backend: deepspeed"):
        load_config(None, ["distributed.context_parallel=2"])
    cfg = load_config(None, ["distributed.backend=deepspeed", "distributed.context_parallel=2"])
    assert cfg.distributed.context_parallel == 2


def test_size_must_divide_the_world() -> None:
    check_context_size(2, 8)
    with pytest.raises(ConfigError, match="does not divide the world of 6"):
        check_context_size(4, 6)


def test_float64_under_deepspeed_is_refused_above_zero_0_at_load() -> None:
    """DeepSpeed reduces float64 gradients in float32 at ZeRO 1-2 and refuses them at ZeRO-3; at ZeRO 0
    treetrain reduces them itself, so a group's update can be checked in float64."""
    float64 = ["distributed.backend=deepspeed", "model.dtype=float64", "distributed.context_parallel=2"]
    for stage in (1, 2, 3):
        with pytest.raises(ConfigError, match=f"distributed.zero_stage: {stage} with model.dtype float64"):
            load_config(None, [*float64, f"distributed.zero_stage={stage}"])
    assert load_config(None, [*float64, "distributed.zero_stage=0"]).model.dtype == "float64"


class _Recording(ContextExchange):
    """A group of 2 that records what the replay asks it to agree on, then refuses (no process group)."""

    def __init__(self) -> None:
        super().__init__(size=2, rank=0)
        self.asked: list[tuple[int, ...]] = []

    def agree(self, what: str, values: Sequence[int], device: torch.device | str = "cpu") -> None:
        self.asked.append(tuple(values))
        raise GroupMismatchError(f"context group: recorded {what}")


def _asked(update: list, version: int = 0) -> tuple[int, ...]:
    model = tiny_model("llama", VOCAB)
    store = ResidentStore(ResidentIdentity.of(model, version=version))
    store.exchange = exchange = _Recording()
    trees = [t for g in update for t in g.trees]
    batch = UpdateBatch.build(trees, [a for g in update for a in g.advantages], LossConfig())
    engine = TreeReplay(model, LossConfig(), ReplayConfig(chunk_size=4), store=store)
    with pytest.raises(GroupMismatchError, match="recorded"):
        engine.accumulate(batch)
    assert all(p.grad is None for p in model.parameters())  # refused before any compute
    (values,) = exchange.asked
    return values


def test_a_groups_replay_first_agrees_on_versions_trees_and_plan() -> None:
    """Before a walk the ranks of a context group agree on (model version, adapter version, a digest of the
    trees and the plan's settings): a rank with a stale shard or other trees is refused on every rank,
    before any attention state is merged (`ContextExchange.agree`, run across ranks in
    tests/models/test_context_exchange.py). Here one rank's side: what it asks the group to agree on."""
    both = groups()
    base = _asked(both)
    assert base[:2] == (0, 0)
    assert _asked(both, version=3)[0] == 3  # a stale shard differs in the version
    assert _asked(both[:1])[2] != base[2]  # other trees differ in the digest
    assert _asked(both)[2] == base[2]  # the same trees give the same digest (the control)
