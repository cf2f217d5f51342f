"""Shared steps of the tests that interrupt a real engine for new weights: resubmit each draft with its
tokens so far, and score a joined sample token by token with the model of each version."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from treetrain.rollout.engines.generation import (
    Completion,
    Draft,
    GenerationRequest,
    GenerationResult,
    StopMatcher,
    continued,
)
from treetrain.rollout.sampling import Sampling


def go_on(
    engine: Any, context: tuple[int, ...], drafts: Sequence[Draft], budget: int, stop: Any
) -> list[Completion]:
    """Each draft finished on `engine` as a request of its own (context plus the draft), joined to it."""
    whole = []
    for slot, draft in enumerate(drafts):
        engine.submit(
            GenerationRequest(
                (*context, *draft.tokens), 1, budget - len(draft.tokens), Sampling(), stop, seed=slot
            )
        )
        results: list[GenerationResult] = []
        while engine.busy:
            results += engine.poll()
        whole.append(continued(draft, results[0].completions[0], StopMatcher.of(stop)))
    return whole


def version_gaps(context: tuple[int, ...], sample: Completion, old: Any, new: Any) -> tuple[float, float]:
    """Largest |recorded - scored| logprob of a sample begun under `old` and finished under `new`: scored by
    the model of each token's own version, and (the negative control) by the other one's."""
    (n_old, _), (_, _) = sample.version_runs
    ids = torch.tensor([context + sample.tokens])
    with torch.no_grad():
        picked = [
            m(ids)
            .logits[0, len(context) - 1 : -1]
            .log_softmax(-1)
            .gather(-1, ids[0, len(context) :, None])[:, 0]
            for m in (old, new)
        ]  # [T] each
    recorded = torch.tensor(sample.logprobs)
    own = torch.cat([picked[0][:n_old], picked[1][n_old:]])
    other = torch.cat([picked[1][:n_old], picked[0][n_old:]])
    return float((own - recorded).abs().max()), float((other - recorded).abs().max())
