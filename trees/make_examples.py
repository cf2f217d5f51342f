"""Write the example trees in trees/ (run by `make trees`). Deterministic: seeded RNG, synthetic token ids.

- `tool_use.msgpack`: one multi-turn tool-use group. The assistant samples different tool calls
  (divergence at assistant turns), a stochastic tool returns different results for the same call
  (divergence at tool results), and some branches call a second tool before answering. Earlier assistant
  turns sit in shared internal nodes. Every policy segment has sampler logprobs and a step reward; two
  trajectories are identical, so they end at the same leaf.
- `long_prefix.msgpack`: a 2048-token prompt shared by 16 short responses, the geometry where tree mode
  pays off most.
- `context_rewrite.msgpack`: agents that rewrite their history. Each trajectory makes two calls; the
  second starts over from the system prompt, keeps the first answer and replaces the tool output by a
  summary, so the two calls share a prefix that includes policy tokens (owned by the first call only).

Usage: python trees/make_examples.py [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

from treetrain.trajectory import Call, Role, Segment, Trajectory, TrajectoryMeta
from treetrain.tree import TrajectoryTree
from treetrain.tree.build import build_tree
from treetrain.tree.format import save_tree

BOS, EOT, TOOL_OPEN, TOOL_CLOSE, ASSISTANT = 1, 2, 3, 4, 5
VOCAB = 32_000


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, VOCAB) for _ in range(n))


def _policy(rng: random.Random, n: int) -> Segment:
    """An assistant turn: sampled tokens ending in EOT, with sampler logprobs."""
    tokens = (*_tokens(rng, n - 1), EOT)
    return Segment(Role.POLICY, tokens, tuple(math.log(rng.uniform(0.05, 1.0)) for _ in tokens))


def _observation(rng: random.Random, n: int) -> Segment:
    """A tool result wrapped in tool markers, followed by the next assistant header."""
    return Segment(Role.OBSERVATION, (TOOL_OPEN, *_tokens(rng, n), TOOL_CLOSE, ASSISTANT))


def _trajectory(i: int, env: str, segments: list[Segment], reward: float, steps: list[float]) -> Trajectory:
    meta = TrajectoryMeta(env=env, seed=i, model_version=0, extra={"task": f"{env}-0"})
    return Trajectory(f"{env}-{i:02d}", (Call(tuple(segments)),), reward, tuple(steps), meta)


def tool_use_tree(seed: int = 0) -> TrajectoryTree:
    rng = random.Random(seed)
    prompt = Segment(Role.PROMPT, (BOS, *_tokens(rng, 240), ASSISTANT))
    episodes: list[tuple[list[Segment], float, list[float]]] = []
    for results_per_call in (2, 1, 2):  # three different first tool calls
        call1 = _policy(rng, rng.randint(16, 32))
        for _ in range(results_per_call):  # the tool is stochastic: same call, different results
            result1 = _observation(rng, rng.randint(30, 80))
            for k in range(2):  # two different second turns after each result
                turn2 = _policy(rng, rng.randint(12, 40))
                if k == 0:  # answers directly
                    reward = float(rng.random() < 0.5)
                    episodes.append(([prompt, call1, result1, turn2], reward, [0.1, reward]))
                else:  # calls a second tool, then answers
                    result2, answer = _observation(rng, rng.randint(20, 40)), _policy(rng, rng.randint(8, 24))
                    reward = float(rng.random() < 0.5)
                    episodes.append(
                        ([prompt, call1, result1, turn2, result2, answer], reward, [0.1, 0.1, reward])
                    )
    episodes.append(episodes[0])  # the same episode sampled twice: two ids, one leaf
    trajs = [_trajectory(i, "tool_use", segs, r, steps) for i, (segs, r, steps) in enumerate(episodes)]
    return build_tree(trajs)


def long_prefix_tree(seed: int = 0, prefix_len: int = 2048, branches: int = 16) -> TrajectoryTree:
    rng = random.Random(seed)
    prompt = Segment(Role.PROMPT, (BOS, *_tokens(rng, prefix_len - 2), ASSISTANT))
    trajs = []
    for i in range(branches):
        answer = _policy(rng, rng.randint(8, 32))
        reward = float(rng.random() < 0.5)
        trajs.append(_trajectory(i, "long_prefix", [prompt, answer], reward, [reward]))
    return build_tree(trajs)


def context_rewrite_tree(seed: int = 0, n: int = 4) -> TrajectoryTree:
    rng = random.Random(seed)
    system = Segment(Role.PROMPT, (BOS, *_tokens(rng, 120), ASSISTANT))
    summary_header = _tokens(rng, 4)
    trajs = []
    for i in range(n):
        first = _policy(rng, rng.randint(10, 20))
        tool = _observation(rng, rng.randint(200, 300))
        second = _policy(rng, rng.randint(10, 20))
        call1 = Call((system, first, tool, second))
        summary = Segment(Role.PROMPT, (*summary_header, *_tokens(rng, 16), ASSISTANT))
        call2 = Call((system, first, summary, _policy(rng, rng.randint(8, 16))))
        reward = float(rng.random() < 0.5)
        meta = TrajectoryMeta(
            env="context_rewrite", seed=i, model_version=0, extra={"task": "context_rewrite-0"}
        )
        # One step reward per policy segment of every call; the repeated first answer gets none of its own.
        steps = (0.1, 0.1, 0.0, reward)
        trajs.append(Trajectory(f"context_rewrite-{i:02d}", (call1, call2), reward, steps, meta))
    return build_tree(trajs)


EXAMPLES = {
    "tool_use.msgpack": tool_use_tree,
    "long_prefix.msgpack": long_prefix_tree,
    "context_rewrite.msgpack": context_rewrite_tree,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="output directory")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, make in EXAMPLES.items():
        tree = make()
        path = os.path.join(args.out, name)
        save_tree(tree, path)
        print(f"wrote {path}: {tree!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
