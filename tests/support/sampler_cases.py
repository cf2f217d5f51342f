"""Trees whose sampler logprobs are the trainer's own plus chosen noise: a sampler that disagrees with the
trainer by a known amount, as an inference engine does (tests of `treetrain.loss.sampler_correction`).

`trainer_logprobs` is the hand computation the engines are checked against: a plain Hugging Face forward
of the whole call, the logits divided by the temperature, log-softmax, the logprob of each token given the
tokens before it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree import TrajectoryTree
from treetrain.tree.build import build_tree


@torch.no_grad()
def trainer_logprobs(
    model: PreTrainedModel, tokens: tuple[int, ...], temperature: float = 1.0
) -> list[float]:
    """log p(token t | tokens < t) under softmax(logits / temperature) for every t (NaN at t = 0, which
    nothing predicts)."""
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0].double()  # [T, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [math.nan] + [float(logp[t - 1, tokens[t]]) for t in range(1, len(tokens))]


def _call(model: PreTrainedModel, call: Call, noise: Callable[[], float], temperature: float) -> Call:
    lps = trainer_logprobs(model, call.tokens, temperature)
    segments, at = [], 0
    for seg in call.segments:
        logprobs = None
        if seg.role is Role.POLICY:
            own = lps[at : at + len(seg)]
            logprobs = tuple(min(0.0, (-1.0 if math.isnan(x) else x) + noise()) for x in own)
        segments.append(Segment(seg.role, seg.tokens, logprobs))
        at += len(seg)
    return Call(tuple(segments))


def resampled(
    trees: list[TrajectoryTree], model: PreTrainedModel, sigma: float, seed: int = 0, temperature: float = 1.0
) -> list[TrajectoryTree]:
    """`trees` with every policy token's sampler logprob set to the model's own at `temperature` plus
    N(0, sigma) noise, so w = exp(trainer - sampler) = exp(-noise) per token when the trainer scores at it."""
    rng = random.Random(seed)
    out = []
    for tree in trees:
        trajs: list[Trajectory] = []
        for i in range(len(tree.records)):
            traj = tree.trajectory(i)
            calls = tuple(_call(model, c, lambda: rng.gauss(0.0, sigma), temperature) for c in traj.calls)
            trajs.append(dataclasses.replace(traj, calls=calls))
        out.append(build_tree(trajs))
    return out


def with_sampler_logprob(
    tree: TrajectoryTree, trajectory: int, policy_token: int, value: float
) -> TrajectoryTree:
    """`tree` with one sampler logprob changed: trajectory `trajectory`'s policy token `policy_token`
    (counted over its calls' policy segments, in order)."""
    trajs = [tree.trajectory(i) for i in range(len(tree.records))]
    traj = trajs[trajectory]
    calls, seen = [], 0
    for call in traj.calls:
        segments = []
        for seg in call.segments:
            if seg.role is Role.POLICY and seg.logprobs is not None:
                lps = list(seg.logprobs)
                if seen <= policy_token < seen + len(seg):
                    lps[policy_token - seen] = value
                seen += len(seg)
                seg = Segment(seg.role, seg.tokens, tuple(lps))
            segments.append(seg)
        calls.append(Call(tuple(segments)))
    trajs[trajectory] = dataclasses.replace(traj, calls=tuple(calls))
    return build_tree(trajs)


def without_sampler_logprobs(trees: list[TrajectoryTree]) -> list[TrajectoryTree]:
    """`trees` as an import without logprobs records them: every policy segment's logprobs None."""
    out = []
    for tree in trees:
        trajs = []
        for i in range(len(tree.records)):
            traj = tree.trajectory(i)
            calls = tuple(Call(tuple(Segment(s.role, s.tokens) for s in c.segments)) for c in traj.calls)
            trajs.append(dataclasses.replace(traj, calls=calls))
        out.append(build_tree(trajs))
    return out
