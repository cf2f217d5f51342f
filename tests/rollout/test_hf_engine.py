"""The HF engine's continuous batching against one request at a time and against the sequential Sampler:
padding, joining, kept prefixes and per-request seeds must not change a single token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.engine_runs import run_requests
from support.env_fixtures import tiny_model, tokenizer

from treetrain.rollout.engines.batch_cache import cache_bytes
from treetrain.rollout.engines.generation import EngineError, GenerationRequest
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.rollout.prefix_sampler import Sampler, SamplerConfig
from treetrain.rollout.sampling import Sampling

torch.set_num_threads(1)
SHARP = tiny_model(init=0.5)  # float64, peaked: a wrong cache or mask visibly changes the tokens
END = ((tokenizer().convert_tokens_to_ids("<|im_end|>"),),)
GREEDY, HOT = Sampling(temperature=0.0), Sampling(temperature=1.0)


def _contexts() -> list[tuple[int, ...]]:
    texts = ["hello there", "a much longer question about the weather in spring", "2+2?", "tell me more"]
    return [
        tuple(tokenizer().encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n")) for t in texts
    ]


def _requests(sampling: Sampling, n: int = 3, children: int = 1) -> list[GenerationRequest]:
    return [
        GenerationRequest(c, n, 12, sampling, END, seed=s, group=f"g{s}", children=children)
        for s, c in enumerate(_contexts())
    ]


@pytest.mark.parametrize("sampling", [GREEDY, HOT])
def test_one_padded_batch_gives_the_samples_of_one_request_at_a_time(sampling: Sampling) -> None:
    together = run_requests(HFEngine(SHARP), _requests(sampling))
    alone = run_requests(
        HFEngine(SHARP, max_rows=1), _requests(sampling)
    )  # one request in the batch at a time
    assert HFEngine(SHARP).merge  # a plain Llama cache: rows of different requests share one padded batch
    for i in together:
        for a, b in zip(together[i].completions, alone[i].completions):
            assert a.tokens == b.tokens and a.finish == b.finish
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-9  # float64


def test_greedy_matches_the_sequential_sampler() -> None:
    sampler = Sampler(SHARP, SamplerConfig(GREEDY), END)
    results = run_requests(HFEngine(SHARP), _requests(GREEDY, n=2))
    for i, context in enumerate(_contexts()):
        reference = sampler.sample(None, context, n=2, max_new_tokens=12, keep_state=False)
        assert [c.tokens for c in results[i].completions] == [s.tokens for s in reference]
        assert [c.stopped for c in results[i].completions] == [s.stopped for s in reference]


def test_a_kept_prefix_serves_the_next_turn_and_a_wrong_one_would_show() -> None:
    observation = tuple(
        tokenizer().encode("<|im_end|>\n<|im_start|>user\nmore please<|im_end|>\n<|im_start|>assistant\n")
    )
    engine = HFEngine(SHARP)
    first = run_requests(engine, _requests(GREEDY, n=1))
    follow = [
        GenerationRequest(c + first[i].completions[0].tokens + observation, 1, 10, GREEDY, END)
        for i, c in enumerate(_contexts())
    ]
    before = engine.stats.encoded_tokens
    reused = run_requests(engine, follow)
    for i, c in enumerate(_contexts()):  # everything but the last sampled token came from the kept KV
        assert reused[i].cached_tokens == len(c) + len(first[i].completions[0].tokens) - 1
    fresh_engine = HFEngine(SHARP, keep_prefixes=False)
    fresh = run_requests(fresh_engine, follow)
    assert all(reused[i].completions == fresh[i].completions for i in reused)
    assert all(fresh[i].cached_tokens == 0 for i in fresh)
    saved = sum(r.cached_tokens for r in reused.values())  # exactly the kept tokens were not encoded again
    assert fresh_engine.stats.encoded_tokens - (engine.stats.encoded_tokens - before) == saved > 0

    broken = HFEngine(SHARP)  # negative control: a kept prefix missing one token changes the answer
    run_requests(broken, _requests(GREEDY, n=1))
    for entry in broken._kept.values():
        entry.cache.crop(-1)
    corrupted = run_requests(broken, follow)
    assert any(corrupted[i].completions[0].tokens != fresh[i].completions[0].tokens for i in fresh)


def test_a_request_samples_the_same_whatever_shares_its_batch() -> None:
    lone = run_requests(HFEngine(SHARP), _requests(HOT)[1:2])[0]
    crowded = run_requests(HFEngine(SHARP), _requests(HOT))[1]
    assert lone.completions == crowded.completions
    reseeded = GenerationRequest(_contexts()[1], 3, 12, HOT, END, seed=99)
    assert run_requests(HFEngine(SHARP), [reseeded])[0].completions != lone.completions


def test_stops_versions_and_weight_sync() -> None:
    engine = HFEngine(SHARP, version=4)
    context = _contexts()[0]
    (greedy,) = run_requests(engine, [GenerationRequest(context, 1, 12, GREEDY, END)]).values()
    tokens = greedy.completions[0].tokens
    assert greedy.completions[0].version == 4
    pair = (tokens[1], tokens[2])  # a two-token stop sequence that the greedy sample contains
    (cut,) = run_requests(engine, [GenerationRequest(context, 1, 12, GREEDY, (*END, pair))]).values()
    assert cut.completions[0].tokens == tokens[:3] and cut.completions[0].finish == "stop"
    (short,) = run_requests(engine, [GenerationRequest(context, 1, 2, GREEDY, END)]).values()
    assert short.completions[0].tokens == tokens[:2] and short.completions[0].finish == "length"
    assert engine._kept
    engine.sync_weights(SHARP, 5)
    assert not engine._kept and engine.version == 5
    (after,) = run_requests(engine, [GenerationRequest(context, 1, 3, GREEDY, END)]).values()
    assert after.completions[0].version == 5
    engine.submit(GenerationRequest(context, 1, 3, GREEDY, END))
    with pytest.raises(EngineError, match="in flight"):
        engine.sync_weights(SHARP, 6)
    engine.abort()  # what the scheduler does when a rollout stops early
    assert not engine.busy
    engine.sync_weights(SHARP, 6)
    assert engine.version == 6


class _FailingOnce(torch.nn.Module):
    """The model, but its `fail_at`-th forward raises (as an out-of-memory error would)."""

    def __init__(self, model: torch.nn.Module, fail_at: int) -> None:
        super().__init__()
        self.model, self.calls, self.fail_at = model, 0, fail_at
        self.config = model.config

    def forward(self, **kwargs: object) -> object:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("forward failed")
        return self.model(**kwargs)


def test_an_engine_that_raised_recovers_and_syncs() -> None:
    failing = _FailingOnce(SHARP, fail_at=3)
    engine = HFEngine(failing)
    with pytest.raises(RuntimeError, match="forward failed"):
        run_requests(engine, _requests(HOT))
    assert engine.busy  # negative control: without an abort the engine still holds the lost requests
    with pytest.raises(EngineError, match="in flight"):
        engine.sync_weights(failing, 1)
    engine.abort()
    engine.sync_weights(failing, 1)
    again = run_requests(engine, _requests(HOT))
    fresh = run_requests(HFEngine(SHARP, version=1), _requests(HOT))
    assert all(again[i].completions == fresh[i].completions for i in fresh)  # nothing of the failure is left


def test_a_rollout_the_engine_failed_leaves_it_idle_for_the_next_sync(tmp_path: Path) -> None:
    from support.env_fixtures import FixedTurnsEnv

    from envs import EpisodeLimits, WrapperConfig
    from treetrain.rollout import FanOut, RolloutConfig, rollout_trees

    failing = _FailingOnce(SHARP, fail_at=4)
    engine = HFEngine(failing)
    config = RolloutConfig(FanOut(root=2), wrapper=WrapperConfig(EpisodeLimits(4, 6, 1024)))
    with pytest.raises(RuntimeError, match="forward failed"):
        rollout_trees(failing, tokenizer(), FixedTurnsEnv, [0, 1], tmp_path / "a", config, engine=engine)
    assert not engine.busy  # the scheduler aborted what was in flight (the test above: else it stays busy)
    engine.sync_weights(failing, 1)
    again = rollout_trees(failing, tokenizer(), FixedTurnsEnv, [0, 1], tmp_path / "b", config, engine=engine)
    assert len(again.trees) == 2 and again.failures == ()


def test_kv_bytes_stay_under_the_bound_and_are_counted() -> None:
    requests = _requests(HOT, n=4, children=2)
    free = HFEngine(SHARP)
    unbounded = run_requests(free, requests)
    one = max(HFEngine(SHARP)._reserve([r]) for r in requests)
    bound = one + one // 2  # room for one request at a time, not for two
    assert free.peak_kv_bytes > bound  # negative control: unbounded, the same requests hold more
    engine = HFEngine(SHARP, max_kv_bytes=bound)
    bounded = run_requests(engine, requests)
    assert 0 < engine.peak_kv_bytes <= bound
    assert engine.stats.forward_calls > free.stats.forward_calls  # requests waited for room
    assert all(bounded[i].completions == unbounded[i].completions for i in unbounded)  # same samples
    kept = list(engine._kept.values())
    pieces = {
        id(p): p for e in kept for p in e.chain
    }  # shared pieces count once (tests/rollout/test_cascade.py)
    piece_bytes = sum(t.numel() * t.element_size() for p in pieces.values() for kv in p.layers for t in kv)
    assert all(e.nbytes == cache_bytes(e.cache) for e in kept)
    assert engine.held_bytes == sum(e.nbytes for e in kept) + piece_bytes > 0


def test_the_generation_types_refuse_what_no_engine_could_serve() -> None:
    with pytest.raises(ValueError, match="at least one context token"):
        GenerationRequest((), 1, 1, HOT, END)
    with pytest.raises(ValueError, match="n and max_new_tokens"):
        GenerationRequest((1,), 0, 1, HOT, END)
    with pytest.raises(ValueError, match="stop sequences"):
        GenerationRequest((1,), 1, 1, HOT, ((),))
