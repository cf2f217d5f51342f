"""The per-rank ledger of a context group: each resident piece is booked on exactly the rank that
`context_shards` says owns it, each rank holds about 1/C of a long prefix, the transfer buffers and the bytes
sent are zero without a group and grow with it, and a tree refused at one rank names the group it needs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.replay_cases import VOCAB
from transformers import PreTrainedModel

from treetrain.errors import ConfigError
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.context_cost import ContextShare, query_bytes
from treetrain.memory.context_need import context_needed
from treetrain.memory.events import MemEvent, Shape, plan_tree
from treetrain.memory.ledger import predict_ledger
from treetrain.memory.persistent import kv_bytes_per_token
from treetrain.memory.plan_search import chunk_candidates
from treetrain.memory.planner import PlanError, plan_update
from treetrain.models.presets import tiny_model
from treetrain.replay import ReplayConfig, UpdateBatch
from treetrain.replay.context_shards import ContextGroup
from treetrain.tree.synthetic import synthetic_group

LOSS = LossConfig(ratio_source="sampler")


def batch_of(prefix: int, branches: int = 2, suffix: int = 8) -> UpdateBatch:
    rewards = [float(i % 2 == 0) for i in range(branches)]
    tree = synthetic_group(
        prefix=prefix, branches=branches, suffix=suffix, depth=1, vocab=VOCAB, seed=3, rewards=rewards
    )
    adv = compute_advantages([tree], AdvantageConfig(zero_variance="keep"))
    return UpdateBatch.build([tree], adv.trees, LOSS)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_model("llama", VOCAB)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_piece_is_booked_on_its_owner_and_nowhere_else(model: PreTrainedModel, size: int) -> None:
    batch = batch_of(700)
    config = ReplayConfig(chunk_size=64, context_parallel=size)
    units = plan_tree(batch.work[0], config, LOSS, kv_bytes_per_token=1).units
    per_token = kv_bytes_per_token(model)
    booked = [
        ContextShare(size, r, 64, query_bytes(model)).unit_bytes(units, per_token, 0) for r in range(size)
    ]
    for u in units.units:
        holders = [r for r in range(size) if booked[r][u.index]]
        want = [] if len(u) == 0 else [ContextGroup(size, 0, 64).owner(u.offset)]
        assert holders == want
        assert sum(b[u.index] for b in booked) == len(u) * per_token


def test_recurrent_state_is_kept_on_every_rank(model: PreTrainedModel) -> None:
    units = plan_tree(batch_of(300).work[0], ReplayConfig(chunk_size=64), LOSS, kv_bytes_per_token=1).units
    booked = [ContextShare(2, r, 64, query_bytes(model)).unit_bytes(units, 0, 7) for r in range(2)]
    assert booked[0] == booked[1] == tuple(7 for _ in units.units)


@pytest.mark.parametrize("contract", ["exact", "response_only"])
def test_each_rank_holds_about_a_cth_of_a_long_prefix(model: PreTrainedModel, contract: str) -> None:
    batch = batch_of(2048)
    one = predict_ledger(batch, model, ReplayConfig(contract=contract, microbatch=1, chunk_size=128), LOSS)  # type: ignore[arg-type]
    for size in (2, 4):
        chunk = chunk_candidates(batch, size)[-1]
        assert chunk is not None
        config = ReplayConfig(contract=contract, microbatch=1, chunk_size=chunk, context_parallel=size)  # type: ignore[arg-type]
        ledger = predict_ledger(batch, model, config, LOSS)
        assert ledger.context is not None and len(ledger.context.rank_peaks) == size
        resident = max(r.bytes.prompt_group for r in ledger.rows)
        whole = max(r.bytes.prompt_group for r in one.rows)
        assert resident <= whole / size + 2 * chunk * kv_bytes_per_token(model) * 2
        assert resident >= whole / size * 0.8


def test_no_group_no_transfers_and_more_ranks_send_more(model: PreTrainedModel) -> None:
    batch = batch_of(512)
    plain = predict_ledger(batch, model, ReplayConfig(chunk_size=64), LOSS)
    assert plain.context is None
    sent = []
    for size in (2, 4, 8):
        ledger = predict_ledger(batch, model, ReplayConfig(chunk_size=64, context_parallel=size), LOSS)
        assert ledger.context is not None
        sent.append(ledger.context.sent_bytes)
        assert ledger.context.resident_bytes == sum(
            len(n) for n in batch.work[0].tree.nodes
        ) * kv_bytes_per_token(model)
    assert 0 < sent[0] < sent[1] < sent[2]


def event(kind: str, past: int, rows: int = 2, width: int = 16, targets: int = 0) -> MemEvent:
    """A forward of `rows` x `width` query tokens against a `past`-token past."""
    shape = Shape(rows=rows, width=width, past=past, pieces=1, targets=targets)
    return MemEvent("e", kind, shape, 0, ())  # type: ignore[arg-type]


def test_transfer_buffers_follow_the_queries_not_the_prefix(model: PreTrainedModel) -> None:
    share = ContextShare(4, 0, 64, query_bytes(model))
    assert share.buffers(event("step", past=0)) == share.sent(event("step", past=0)) == 0  # nothing remote
    assert share.buffers(event("step", past=64)) == share.buffers(event("step", past=4096))
    assert share.sent(event("score", past=64)) == share.sent(event("score", past=4096)) > 0
    assert share.buffers(event("step", 64, rows=4)) == 2 * share.buffers(event("step", 64, rows=2))
    assert share.sent(event("step", 64)) > share.sent(event("score", 64))  # backward all_reduces dO
    assert ContextShare(1, 0, 0, query_bytes(model)).sent(event("step", 64)) == 0


def test_transfers_count_each_backward_that_runs(model: PreTrainedModel) -> None:
    """A kept graph's backward reduces dO like a step's; without loss targets (a prompt chunk) the top
    attention layer's backward never runs. `test_train_context` holds the engine's counts to these."""
    sizes = query_bytes(model)
    share = ContextShare(2, 0, 64, sizes)
    tokens, layers = 2 * 16, sizes.layers
    gather = (sizes.out + sizes.lse) * tokens * layers
    assert sizes.untargeted == layers - 1 and layers > 1
    assert share.contributed(event("score", 64)) == gather
    assert share.contributed(event("step", 64, targets=3)) == gather + sizes.grad * tokens * layers
    assert share.contributed(event("keep", 64)) == share.contributed(event("step", 64))
    assert share.contributed(event("step", 64)) == gather + sizes.grad * tokens * (layers - 1)


def test_each_rank_attends_to_its_own_pieces_and_together_to_the_whole_past(model: PreTrainedModel) -> None:
    config = ReplayConfig(contract="exact", microbatch=2, chunk_size=64)
    tp = plan_tree(batch_of(700, branches=4).work[0], config, LOSS, kv_bytes_per_token=1)
    with_past = [ev for ev in tp.events if ev.shape.past]
    assert with_past
    for size in (2, 3):
        shares = [ContextShare(size, r, 64, query_bytes(model)) for r in range(size)]
        for ev in with_past:
            local = [share.local(tp.units, ev) for share in shares]
            assert sum(s.past for s in local) == ev.shape.past
            assert sum(s.pieces for s in local) == ev.shape.pieces
            assert all(s.rows == ev.shape.rows and s.width == ev.shape.width for s in local)
            if ev.shape.path_tokens:
                assert sum(s.path_tokens for s in local) == ev.shape.path_tokens


def test_context_chunks_cut_the_longest_node_evenly() -> None:
    batch = batch_of(1000)
    for size in (2, 3, 4):
        for chunk in chunk_candidates(batch, size):
            assert chunk is not None and (chunk >= 16 or chunk == chunk_candidates(batch, size)[0])
            blocks = -(-1000 // chunk)
            owners = [ContextGroup(size, 0, chunk).owner(b * chunk) for b in range(blocks)]
            counts = [owners.count(r) for r in range(size)]
            assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_context_parallel_must_be_a_positive_whole_number(bad: object) -> None:
    with pytest.raises(ConfigError, match="context_parallel"):
        ReplayConfig(context_parallel=bad)  # type: ignore[arg-type]


def test_a_refused_tree_names_the_group_it_needs_and_that_group_fits(model: PreTrainedModel) -> None:
    batch = batch_of(4096)
    top = plan_update(batch, model, budget=1 << 30, loss=LOSS, base=ReplayConfig(microbatch=1, chunk_size=64))
    persistent = top.ledger.peak.persistent + top.ledger.peak.boundary
    resident = max(r.bytes.prompt_group for r in top.ledger.rows)
    budget = persistent + resident // 2  # half the prefix's state: one device cannot hold it
    with pytest.raises(PlanError, match=r"needs distributed\.context_parallel >= (\d+)") as refused:
        plan_update(batch, model, budget=budget, loss=LOSS)
    size = int(str(refused.value).split(">= ")[1].split()[0])
    assert "\n" not in str(refused.value) and size >= 2
    plan = plan_update(batch, model, budget=budget, loss=LOSS, base=ReplayConfig(context_parallel=size))
    assert plan.mode == "tree" and plan.ledger.peak.total <= budget
    assert plan.ledger.context is not None and plan.ledger.context.size == size
    assert context_needed(batch, model, LOSS, ReplayConfig(), budget, None, None) == size


def test_no_group_is_named_when_sharding_cannot_help(model: PreTrainedModel) -> None:
    batch = batch_of(256)
    ledger = predict_ledger(batch, model, ReplayConfig(), LOSS)
    with pytest.raises(PlanError) as refused:
        plan_update(batch, model, budget=ledger.peak.persistent // 2, loss=LOSS)
    assert "context_parallel" not in str(refused.value)
    assert replace(ReplayConfig(), context_parallel=3).context_parallel == 3


@pytest.mark.parametrize(
    ("family", "layers", "untargeted"),
    [("llama", 2, 1), ("falcon_h1", 2, 1), ("zamba2", 2, 2), ("zamba", 2, 2), ("gemma4_text", 4, 1)],
)
def test_without_targets_only_attention_that_feeds_resident_state_reduces(
    family: str, layers: int, untargeted: int
) -> None:
    """A forward without loss targets (a prompt chunk) backpropagates only from resident state, so an
    attention layer reduces dO there only when its output reaches state kept after it. Llama's and
    Falcon-H1's top attention reaches only the logits (Falcon-H1's mixer reads the layer's input beside its
    attention). Zamba 2's hybrid layer runs its Mamba mixer over the shared block's output, so its top
    attention reduces too. Gemma 4's top half reuses the bottom half's KV: those layers attend, gather and,
    with targets, reduce like any other, but keep nothing, so without targets only the layers below the last
    one keeping KV of its own reduce. (Booking Zamba 2 like Falcon-H1 predicted 21 % fewer bytes than its
    group put in, and Gemma 4's group put in other bytes than its ledger's while the shared layers were
    left out; tests/distributed/test_context_groups.py holds the bytes equal for every family it runs.)"""
    model = tiny_model(family, VOCAB, attn="eager" if family == "zamba" else "sdpa")
    sizes = query_bytes(model)
    assert (sizes.layers, sizes.untargeted) == (layers, untargeted)
