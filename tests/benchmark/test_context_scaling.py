"""The context-group benchmark's library: longer prefixes fit one rank's budget as the group grows, the
bytes-sent breakdown adds up to the ledger's own total."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import PreTrainedModel

from treetrain.benchmark.bench_config import QUICK, GridPoint
from treetrain.benchmark.context_scaling import (
    BRANCHES,
    SHARED,
    Geometry,
    Search,
    longest_prefix_per_rank,
    replay_for,
    transfer_breakdown,
)
from treetrain.benchmark.workload import LOSS, bench_batch, bench_model
from treetrain.memory.ledger import predict_ledger

SEARCH = Search(1 << 20, QUICK.chunk_size, QUICK.microbatch, step=64, top=1 << 13)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return bench_model(QUICK.model)


@pytest.mark.parametrize("contract", ["exact", "response_only"])
def test_a_larger_group_holds_a_longer_prefix_within_the_same_budget(
    model: PreTrainedModel, contract: str
) -> None:
    fits = [longest_prefix_per_rank(model, Geometry(8, 8), contract, SEARCH, c, QUICK) for c in (1, 2)]  # type: ignore[arg-type]
    assert 0 < fits[0].prefix < fits[1].prefix
    assert all(f.peak.total <= SEARCH.budget and not f.capped for f in fits)
    over = bench_batch(GridPoint(fits[1].prefix + SEARCH.step, 8, 8, 1), QUICK)
    assert predict_ledger(over, model, replay_for(contract, SEARCH, 2), LOSS).peak.total > SEARCH.budget  # type: ignore[arg-type]


def test_the_breakdown_adds_up_to_the_ledgers_bytes_sent(model: PreTrainedModel) -> None:
    point = GridPoint(512, 4, 16, 1)
    for contract in ("exact", "response_only"):
        t = transfer_breakdown(model, point, contract, SEARCH, 4, QUICK)  # type: ignore[arg-type]
        ledger = predict_ledger(
            bench_batch(point, replace(QUICK, reps=1)), model, replay_for(contract, SEARCH, 4), LOSS
        )  # type: ignore[arg-type]
        assert ledger.context is not None and t.total == ledger.context.sent_bytes
        assert t.sent[BRANCHES] > 0 and t.sent[SHARED] > 0
    assert transfer_breakdown(model, point, "exact", SEARCH, 1, QUICK).total == 0
