"""A context group's replay first has its ranks agree on what they are about to run
(`TreeReplay.accumulate` -> `ContextExchange.agree`): the model and adapter versions, the trees, the replay
settings and this rank's schedule. Here one rank's side, with an exchange that records what it is asked and
refuses; the collective itself runs across ranks in tests/models/test_context_exchange.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from support.dist_cases import VOCAB, Group, groups

from treetrain.loss.loss_config import LossConfig
from treetrain.memory.replay_layout import lay_out
from treetrain.models.context_exchange import ContextExchange, GroupMismatchError
from treetrain.models.presets import tiny_model
from treetrain.replay import ReplayConfig, TreeReplay, UpdateBatch
from treetrain.replay.resident import ResidentIdentity, ResidentStore


class _Recording(ContextExchange):
    """A group of 2 that records what the replay asks it to agree on, then refuses (no process group)."""

    def __init__(self) -> None:
        super().__init__(size=2, rank=0)
        self.asked: list[tuple[int, ...]] = []

    def agree(self, what: str, values: Sequence[int], device: torch.device | str = "cpu") -> None:
        self.asked.append(tuple(values))
        raise GroupMismatchError(f"context group: recorded {what}")


def _asked(update: list[Group], version: int = 0, keep: bool = False) -> tuple[int, ...]:
    model = tiny_model("llama", VOCAB)
    store = ResidentStore(ResidentIdentity.of(model, version=version))
    store.exchange = exchange = _Recording()
    trees = [t for g in update for t in g.trees]
    batch = UpdateBatch.build(trees, [a for g in update for a in g.advantages], LossConfig())
    replay = ReplayConfig(chunk_size=4)
    keep_graph = (lambda units: frozenset(u.index for u in units.units if u.children)) if keep else None
    schedule = lay_out(batch, model, LossConfig(), replay, keep_graph=keep_graph).schedule
    engine = TreeReplay(model, LossConfig(), replay, store=store)
    with pytest.raises(GroupMismatchError, match="recorded"):
        engine.accumulate(batch, schedule)
    assert all(p.grad is None for p in model.parameters())  # refused before any compute
    (values,) = exchange.asked
    return values


def test_a_groups_replay_first_agrees_on_versions_trees_and_schedule() -> None:
    """A rank with a stale shard (another version), other trees or another schedule (here one that keeps the
    internal units' graphs) asks the group to agree on other values, so every rank refuses before any
    attention state is merged."""
    both = groups()
    base = _asked(both)
    assert base[:2] == (0, 0)
    assert _asked(both, version=3)[0] == 3  # a stale shard differs in the version
    assert _asked(both[:1])[2] != base[2]  # other trees differ in the digest
    assert _asked(both, keep=True)[2] != base[2]  # another schedule differs in the digest
    assert _asked(both)[2] == base[2]  # the same trees and schedule give the same digest (the control)
