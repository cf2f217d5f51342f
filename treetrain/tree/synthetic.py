"""Synthetic trees of a chosen geometry, for tests, benchmarks and the planner's what-if analysis.

`synthetic_group(prefix=P, branches=G, suffix=S, depth=d)` builds G trajectories that share a P-token prompt
and then take d turns (a policy segment followed, except after the last turn, by an observation). The
suffix of S tokens after the prompt is spread over the turns. Branching is spread over the turns too: the
fan-outs multiply to G (8 over 3 turns is 2 x 2 x 2; 2 over 3 turns is 2 x 1 x 1), so deeper trees
have policy tokens in shared internal nodes. Token ids are random in [1, vocab).

Example:
    >>> tree = synthetic_group(prefix=64, branches=4, suffix=16, depth=2, vocab=50, seed=0)
    >>> from treetrain.tree.stats import tree_stats
    >>> s = tree_stats(tree)
    >>> s.num_trajectories, s.num_leaves, s.total_tokens
    (4, 4, 320)
"""

from __future__ import annotations

import math
import random

from treetrain.trajectory import Call, Role, Segment, Trajectory, TrajectoryMeta
from treetrain.tree.build import build_tree
from treetrain.tree.trajectory_tree import TrajectoryTree


def fanouts(branches: int, depth: int) -> list[int]:
    """Per-turn branching factors whose product is `branches`, largest first."""
    if branches < 1 or depth < 1:
        raise ValueError("branches and depth must be >= 1")
    out = [1] * depth
    remaining = branches
    for i in range(depth):
        left = depth - i
        f = max(1, round(remaining ** (1 / left)))
        while remaining % f:
            f -= 1
        out[i] = f
        remaining //= f
    out[-1] *= remaining
    return sorted(out, reverse=True)


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def synthetic_group(
    *,
    prefix: int,
    branches: int,
    suffix: int,
    depth: int = 1,
    vocab: int = 256,
    seed: int = 0,
    observation_fraction: float = 0.25,
    rewards: list[float] | None = None,
    with_logprobs: bool = True,
) -> TrajectoryTree:
    """One tree of `branches` trajectories; see the module docstring for the shape."""
    if prefix < 1 or suffix < depth:
        raise ValueError("prefix must be >= 1 and suffix >= depth (each turn needs a token)")
    rng = random.Random(seed)
    fans = fanouts(branches, depth)
    turn_len = _split(suffix, depth)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, vocab) for _ in range(n))

    def policy(n: int) -> Segment:
        lps = tuple(-rng.random() * 3 for _ in range(n)) if with_logprobs else None
        return Segment(Role.POLICY, tokens(n), lps)

    prompt = Segment(Role.PROMPT, tokens(prefix))
    # paths[g] is the list of segments of trajectory g, built turn by turn with shared objects
    paths: list[list[Segment]] = [[prompt]]
    for turn in range(depth):
        n_obs = (
            0
            if turn == depth - 1
            else min(turn_len[turn] - 1, math.floor(turn_len[turn] * observation_fraction))
        )
        n_pol = turn_len[turn] - n_obs
        grown: list[list[Segment]] = []
        for segs in paths:
            for _ in range(fans[turn]):
                turn_segs = [policy(n_pol)]
                if n_obs:
                    turn_segs.append(Segment(Role.OBSERVATION, tokens(n_obs)))
                grown.append(segs + turn_segs)
        paths = grown
    rs = rewards if rewards is not None else [float(rng.random() < 0.5) for _ in paths]
    if len(rs) != len(paths):
        raise ValueError(f"{len(rs)} rewards for {len(paths)} trajectories")
    trajs = [
        Trajectory(
            f"s{seed}-{g}", (Call(tuple(segs)),), rs[g], meta=TrajectoryMeta(env="synthetic", seed=seed)
        )
        for g, segs in enumerate(paths)
    ]
    return build_tree(trajs)
