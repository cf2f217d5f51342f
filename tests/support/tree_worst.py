"""Constructed worst cases for loading: valid, canonical tree files built directly as msgpack documents
(building them through `build_tree` would itself take time in proportion to every call)."""

from __future__ import annotations

import msgpack
import numpy as np


def _node(parent: int | None, tokens: list[int], roles: list[int]) -> dict[str, object]:
    return {"parent": parent, "tokens": np.asarray(tokens, dtype="<u4").tobytes(), "roles": bytes(roles)}


def _traj(tid: str, calls: list[dict[str, object]]) -> dict[str, object]:
    meta = {"env": "", "seed": None, "model_version": None, "extra": {}}
    return {"id": tid, "reward": 0.0, "step_rewards": [], "meta": meta, "calls": calls}


def _doc(nodes: list[dict[str, object]], trajs: list[dict[str, object]]) -> bytes:
    tree = {"nodes": nodes, "trajectories": trajs}
    return msgpack.packb({"format": "treetrain.tree", "version": 1, "trees": [tree]}, use_bin_type=True)


def comb_chain(depth: int) -> tuple[list[dict[str, object]], list[dict[str, object]], int]:
    """The comb's nodes and trajectories, and the index of its deepest chain node."""
    nodes, trajs, parent = [_node(None, [], [])], [], 0
    for k in range(depth):
        chain = len(nodes)
        nodes.append(_node(parent, [2], [0]))
        nodes.append(_node(chain, [1], [1]))
        trajs.append(_traj(f"t{k}", [{"end": chain + 1, "segment_lengths": [k + 1, 1], "logprobs": [None]}]))
        parent = chain
    return nodes, trajs, parent


def comb(depth: int) -> bytes:
    """A long chain of one-token prompt nodes, each with a one-token policy leaf ending its own trajectory.

    Trajectory k passes through k + 2 nodes, so the (node, trajectory) pairs grow as depth**2 / 2 while
    the file grows as depth.
    """
    nodes, trajs, parent = comb_chain(depth)
    last = trajs[-1]["calls"]
    assert isinstance(last, list)
    last.append(
        {"end": parent, "segment_lengths": [depth], "logprobs": []}
    )  # the chain's end is a call's end
    return _doc(nodes, trajs)


def wide(width: int, prompt: int = 64) -> bytes:
    """One shared prompt node with `width` one-token policy children, one trajectory each."""
    nodes = [_node(None, [], []), _node(0, list(range(3, 3 + prompt)), [0] * prompt)]
    trajs = []
    for k in range(width):
        nodes.append(_node(1, [10_000 + k], [1]))
        trajs.append(_traj(f"t{k}", [{"end": k + 2, "segment_lengths": [prompt, 1], "logprobs": [None]}]))
    return _doc(nodes, trajs)


def shared_calls(prefix: int, calls: int, logprobs: bool = False) -> bytes:
    """One trajectory of `calls` calls that all run through one `prefix`-token node: T = calls x prefix.

    With `logprobs`, every call carries the sampler's logprob of its one policy token."""
    nodes = [_node(None, [], []), _node(0, [5] * prefix, [0] * (prefix - 1) + [1])]
    lps = np.full(1, -0.5, dtype="<f8").tobytes() if logprobs else None
    call = {"end": 1, "segment_lengths": [prefix - 1, 1], "logprobs": [lps]}
    return _doc(nodes, [_traj("t", [call] * calls)])
