"""`response_only` equals an independent detached-prefix reference.

The reference knows nothing of units, schedules, stores or sibling batching. For every call and every node on
its path it runs, from scratch: the call's tokens before the node (minus the last one) without a graph, then
that last token plus the node's tokens under autograd, and the loss of the call's owned policy tokens in the
node. That is the contract in words: gradient never crosses resident KV.
"""

from __future__ import annotations

import pytest
import torch
from support.replay_cases import SHAPES, factory, make_batch

from treetrain.loss.loss_config import LossConfig
from treetrain.loss.objective import Contributions, objective
from treetrain.loss.targets import TargetTable, call_targets
from treetrain.models.decoder import decoder_forward
from treetrain.replay import ReplayConfig, UpdateBatch
from treetrain.replay.pieces import gather_targets, pad_pieces, target_stats
from treetrain.replay.verify import deviation, flat_grad, noise_floor, tree_gradient
from treetrain.tree.trajectory_tree import CallRef

FACTOR = 5.0


def _node_slice(table: TargetTable, lo: int, hi: int, shift: int) -> TargetTable:
    """Targets of a call predicted at positions [lo, hi), re-based by `shift`."""
    keep_t = (table.positions >= lo) & (table.positions < hi)
    import numpy as np

    idx = np.nonzero(keep_t)[0]
    remap = {int(t): i for i, t in enumerate(idx)}
    keep_c = np.isin(table.contrib_target, idx)
    return TargetTable(
        table.positions[idx] - shift,
        table.tokens[idx],
        np.array([remap[int(t)] for t in table.contrib_target[keep_c]], dtype=np.int64),
        table.coef[keep_c],
        table.advantage[keep_c],
        table.sampler_logprob[keep_c],
        table.trajectory[keep_c],
    )


def detached_prefix_gradient(model, batch: UpdateBatch, loss: LossConfig) -> torch.Tensor:
    assert loss.ratio_source == "sampler" and not loss.needs_reference
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    for work in batch.work:
        tree = work.tree
        for t in sorted(work.trajectories):
            for c in range(len(tree.records[t].calls)):
                ref = CallRef(t, c)
                tokens = tree.call_tokens(ref)[0]
                table = call_targets(tree, ref, work.advantages, batch.manifest, loss)
                for n in tree.path(tree.call_end(ref)):
                    node = tree.nodes[n]
                    start = max(0, node.offset - 1)  # the last token before the node, if any
                    piece = _node_slice(table, start, node.end - 1, start)
                    if piece.num_targets == 0:
                        continue
                    past = None
                    if start > 0:
                        with torch.no_grad():
                            pre = decoder_forward(
                                model, torch.tensor([tokens[:start]]), torch.arange(start)[None], None
                            )
                        past = list(zip(pre.keys, pre.values))
                    padded = pad_pieces([tokens[start : node.end]], [start], device)
                    out = decoder_forward(model, padded.input_ids, padded.positions, past)
                    gathered = gather_targets([piece], padded.input_ids.shape[1], device)
                    logp, _ = target_stats(
                        model, out.hidden, gathered, with_entropy=False, max_logit_elements=1 << 20
                    )
                    con = gathered.contributions
                    contrib = Contributions(con.target, con.coef, con.advantage, con.old_logprob)
                    objective(loss, logp, contrib).loss.backward()
    return flat_grad(model)


@pytest.mark.parametrize("shape", ["one_level", "multi_level", "two_trees", "unequal"])
@pytest.mark.parametrize(
    "replay",
    [
        ReplayConfig(contract="response_only", microbatch=1),
        ReplayConfig(contract="response_only", microbatch=0),
    ],
    ids=["K1", "Kall"],
)
def test_response_only_equals_detached_prefix_reference(shape: str, replay: ReplayConfig) -> None:
    loss = LossConfig(ratio_source="sampler")
    make = factory("qwen2", torch.float64)
    batch = make_batch(SHAPES[shape](0), loss)
    reference = detached_prefix_gradient(make(), batch, loss)
    tree = tree_gradient(make(), batch, loss, replay)
    floor = noise_floor(make, batch, loss)
    dev = deviation(tree, reference)
    assert float(reference.norm()) > 0
    assert dev.abs <= FACTOR * floor, f"{shape}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


def test_response_only_really_differs_from_exact() -> None:
    """The reference is not accidentally the exact gradient (else the test above proves nothing new)."""
    loss = LossConfig(ratio_source="sampler")
    make = factory("qwen2", torch.float64)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    reference = detached_prefix_gradient(make(), batch, loss)
    exact = tree_gradient(make(), batch, loss, ReplayConfig(contract="exact"))
    assert deviation(exact, reference).rel > 1e-3
