"""The sequential Sampler on models with recurrent state in their cache (Qwen3.5: Gated DeltaNet layers
beside attention layers; Zamba 2 and Falcon-H1: KV and Mamba-2 state in one layer): every sample and every
kept branch state must score exactly as a forward of the whole sequence."""

from __future__ import annotations

import pytest
import torch

from treetrain.models.presets import tiny_model
from treetrain.rollout.prefix_sampler import Sampler, SamplerConfig
from treetrain.rollout.sampling import Sampling

torch.set_num_threads(1)
VOCAB = 64
NEVER = ((VOCAB + 1,),)  # no stop: every turn runs to its length
TOL = 1e-3  # the recurrent kernels compute in float32 inside these float64 models; a wrong row is off by O(1)


@pytest.fixture(scope="module", params=["qwen3_5_text", "zamba2", "falcon_h1"])
def hybrid(request: pytest.FixtureRequest) -> torch.nn.Module:
    model = tiny_model(request.param, VOCAB, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # peaked logits: a wrong row of the state visibly changes the tokens
    return model


def _logprobs(model: torch.nn.Module, ids: list[int], start: int) -> list[float]:
    """Log-probability of each of `ids[start:]` from one uncached forward of the whole sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[t - 1, ids[t]]) for t in range(start, len(ids))]


def test_samples_and_kept_states_score_as_a_whole_forward(hybrid: torch.nn.Module) -> None:
    sampler = Sampler(hybrid, SamplerConfig(Sampling(temperature=1.0), seed=3), NEVER)
    context = [5, 9, 11, 3, 7, 2]
    first = sampler.sample(None, context, n=3, max_new_tokens=5)
    assert len({s.tokens for s in first}) > 1  # the rows drew differently, so a row mix-up would show
    for s in first:
        whole = context + list(s.tokens)
        assert max(abs(a - b) for a, b in zip(s.logprobs, _logprobs(hybrid, whole, len(context)))) < TOL
    # each branch continues from its own kept state: the state before its last token, plus a user turn
    for s in first:
        turn = [s.tokens[-1], 4, 6, 8]
        (again,) = sampler.sample(s.state, turn, n=1, max_new_tokens=4)
        whole = context + list(s.tokens) + turn[1:] + list(again.tokens)
        want = _logprobs(hybrid, whole, len(whole) - len(again.tokens))
        assert max(abs(a - b) for a, b in zip(again.logprobs, want)) < TOL


def test_greedy_rows_agree_with_each_other(hybrid: torch.nn.Module) -> None:
    sampler = Sampler(hybrid, SamplerConfig(Sampling(temperature=0.0)), NEVER)
    samples = sampler.sample(None, [1, 2, 3, 4], n=4, max_new_tokens=6, keep_state=False)
    assert len({s.tokens for s in samples}) == 1


def test_a_forked_cache_holds_the_rows_asked_for_in_that_order(hybrid: torch.nn.Module) -> None:
    """`fork_cache` with rows reordered (as the engine forks a branch's samples): continuing row j of the
    fork scores as continuing row rows[j] of the original."""
    from treetrain.rollout.prefix_sampler import fork_cache

    sampler = Sampler(hybrid, SamplerConfig(Sampling(temperature=1.0), seed=5), NEVER)
    samples = sampler.sample(None, [5, 9, 11, 3], n=3, max_new_tokens=3)
    for s in samples:
        twin = fork_cache(s.state.cache, [0])  # a copy: the original state is left for the next check
        (a,) = sampler.sample(
            type(s.state)(twin, s.state.length), [s.tokens[-1]], n=1, max_new_tokens=2, keep_state=False
        )
        whole = [5, 9, 11, 3, *s.tokens, *a.tokens]
        assert max(abs(x - y) for x, y in zip(a.logprobs, _logprobs(hybrid, whole, len(whole) - 2))) < TOL
