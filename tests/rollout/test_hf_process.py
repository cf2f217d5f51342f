"""The `hf` engine in its own process (`HFProcessEngine`) against the in-process `HFEngine`, weights by
version through the shared shadow, and the child's lifetime.

Differential: the same requests and seeds give the same tokens on both engines, and logprobs within the
float64 noise floor (rows batched differently differ in the last bits). Weights: after a publish and a sync
the child's logprobs are the new model's as the trainer scores them, not the old one's (negative control);
a publish while the child decodes leaves what it samples alone, which a child sampling from the shadow
would not. Lifetime: kill -9 of the parent leaves no child, and a child that raises or dies is one
`EngineError` line."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.gated_env import wait_for
from support.processes import alive, name
from transformers import LlamaConfig, LlamaForCausalLM

from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.factory import EngineSpec, make_engine
from treetrain.rollout.engines.generation import EngineError, GenerationRequest, GenerationResult
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.rollout.engines.hf_process import PROCESS_NAME, HFProcessEngine
from treetrain.rollout.engines.sampler_process import SamplerProcess
from treetrain.rollout.sampling import Sampling
from treetrain.rollout.weight_feed import WeightFeed

pytestmark = pytest.mark.launch  # each test starts a sampler process (about 3 s of imports)

torch.set_num_threads(1)
VOCAB = 97
NEVER = ((VOCAB + 1,),)
"""A stop no sample can draw: every sample runs its whole budget."""
FLOOR = 1e-10
"""One row's logprobs on the two engines (float64 model; rows batched differently): measured at most 0."""
SCORED = 2e-6
"""Recorded logprobs against the trainer's scoring of the same weights: the engine draws from float32
logits, so float32 rounding (measured at most 3.4e-7)."""


def tiny(seed: int) -> LlamaForCausalLM:
    """A random-init Llama whose outputs depend visibly on far-back context (init 0.5)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.5,
    )  # fmt: skip
    return LlamaForCausalLM(config).double().eval()


def requests(seed: int = 0) -> list[GenerationRequest]:
    """Five requests of different lengths, sampling settings and stops, n = 3."""
    out = []
    for i in range(5):
        context = tuple((7 * i + 3 * k) % VOCAB for k in range(4 + 3 * i))
        sampling = Sampling(temperature=0.8) if i % 2 else Sampling()
        out.append(GenerationRequest(context, 3, 8 + 4 * i, sampling, ((5,), (11, 12)), seed=seed + i))
    return out


def run(engine: object, batch: list[GenerationRequest]) -> dict[int, GenerationResult]:
    """Every request of `batch` in flight at once (the second half sent after the first step), by index."""
    ids = [engine.submit(r) for r in batch[:2]]  # type: ignore[attr-defined]
    done = list(engine.poll())  # type: ignore[attr-defined]
    ids += [engine.submit(r) for r in batch[2:]]  # type: ignore[attr-defined]
    while engine.busy:  # type: ignore[attr-defined]
        done += engine.poll()  # type: ignore[attr-defined]
    by_id = {r.request_id: r for r in done}
    assert sorted(by_id) == sorted(ids)
    return {i: by_id[rid] for i, rid in enumerate(ids)}


def gap(a: dict[int, GenerationResult], b: dict[int, GenerationResult]) -> float:
    """Largest logprob difference of two runs whose tokens are equal."""
    for i in a:
        assert [c.tokens for c in a[i].completions] == [c.tokens for c in b[i].completions], i
    return max(abs(x - y) for i in a for c, d in zip(a[i].completions, b[i].completions) for x, y in zip(c.logprobs, d.logprobs))  # fmt: skip


def scored(model: LlamaForCausalLM, context: tuple[int, ...], result: GenerationResult) -> float:
    """Largest |recorded - model's| logprob of a temperature-1 result's tokens, the trainer's way (one
    forward over context and sample)."""
    worst = 0.0
    for c in result.completions:
        ids = torch.tensor([[*context, *c.tokens]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)  # [T, V]
        for k, (tok, lp) in enumerate(zip(c.tokens, c.logprobs)):
            worst = max(worst, abs(float(logp[len(context) + k - 1, tok]) - lp))
    return worst


@pytest.fixture
def feed_engine():  # type: ignore[no-untyped-def]
    policy = tiny(0)
    feed = WeightFeed(policy, version=0, shared=True)
    spec = EngineSpec("hf", VLLMSettings(), "/tmp", "tiny", "tiny", 256, in_flight_weights=True, threads=None)
    engine = make_engine(spec, feed.sampling_model)
    assert isinstance(engine, HFProcessEngine)
    try:
        feed.sync(engine)
        yield policy, feed, engine
    finally:
        engine.close()


def test_the_process_engine_samples_what_the_in_process_engine_does(feed_engine) -> None:  # type: ignore[no-untyped-def]
    policy, _, engine = feed_engine
    assert engine.version == 0 and engine.child_threads == 1 and name(engine.pid) == PROCESS_NAME
    assert 0 < engine.startup_seconds < 60, engine.startup_seconds
    got = run(engine, requests())
    want = run(HFEngine(copy.deepcopy(policy), version=0), requests())
    assert gap(got, want) < FLOOR, gap(got, want)
    assert all(c.version == 0 for r in got.values() for c in r.completions)
    assert {len(c.tokens) for r in got.values() for c in r.completions} != {1}  # samples of several tokens
    assert engine.stats.requests == 5 and engine.stats.sampled_tokens == sum(
        len(c.tokens) for r in got.values() for c in r.completions
    )
    other = run(engine, requests(seed=100))  # negative control: other seeds draw other tokens
    assert any(
        [c.tokens for c in other[i].completions] != [c.tokens for c in got[i].completions] for i in got
    )


def test_after_a_publish_and_a_sync_the_child_samples_the_new_weights(feed_engine) -> None:  # type: ignore[no-untyped-def]
    policy, feed, engine = feed_engine
    old = copy.deepcopy(policy)
    request = GenerationRequest((3, 1, 4, 1, 5, 9, 2, 6), 4, 12, Sampling(), NEVER, seed=7)
    (before,) = run(engine, [request]).values()
    assert scored(old, request.context, before) < SCORED
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    feed.publish(policy, 1)
    (stale,) = run(engine, [request]).values()  # published, not yet synced: still version 0
    assert stale.completions[0].version == 0 and scored(old, request.context, stale) < SCORED
    feed.sync(engine)
    assert engine.version == 1 and engine.stats.weight_syncs == 2
    (after,) = run(engine, [request]).values()
    assert all(c.version == 1 for c in after.completions)
    assert scored(policy, request.context, after) < SCORED
    assert scored(old, request.context, after) > 1e-3  # negative control: not the old weights


def test_a_publish_while_the_child_decodes_does_not_change_what_it_samples(feed_engine) -> None:  # type: ignore[no-untyped-def]
    policy, feed, engine = feed_engine
    old = copy.deepcopy(policy)
    long = GenerationRequest((8, 6, 7, 5, 3, 0, 9), 2, 400, Sampling(), NEVER, seed=3)
    short = GenerationRequest((2, 7, 1, 8), 1, 2, Sampling(), NEVER, seed=4)
    slow, quick = engine.submit(long), engine.submit(short)
    done: list[GenerationResult] = []
    while not any(r.request_id == quick for r in done):  # the child is now decoding `long`
        done += engine.poll()
    assert engine.busy and all(r.request_id != slow for r in done)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    feed.publish(policy, 1)
    while engine.busy:
        done += engine.poll()
    (got,) = (r for r in done if r.request_id == slow)
    (want,) = run(HFEngine(old, version=0), [long]).values()
    assert gap({0: got}, {0: want}) < FLOOR
    (moved,) = run(HFEngine(copy.deepcopy(policy), version=0), [long]).values()
    assert [c.tokens for c in moved.completions] != [c.tokens for c in got.completions]  # negative control


def test_interrupt_goes_to_the_child_engine(feed_engine) -> None:  # type: ignore[no-untyped-def]
    """Every request in flight comes back once, each sample a prefix of what it would have drawn, and the
    engine is idle."""
    policy, _, engine = feed_engine
    batch = [GenerationRequest((4, 4 + i, 9), 2, 300, Sampling(), NEVER, seed=i) for i in range(3)]
    ids = [engine.submit(r) for r in batch]
    done = engine.poll()
    stopped = engine.interrupt()
    assert not done and not engine.busy and engine.poll() == []
    assert sorted(s.request_id for s in stopped) == ids
    assert any(len(sample.tokens) < 300 for s in stopped for sample in s.samples)  # stopped mid-way
    full = run(HFEngine(copy.deepcopy(policy), version=0), batch)
    for s in stopped:
        for sample, whole in zip(s.samples, full[ids.index(s.request_id)].completions):
            assert whole.tokens[: len(sample.tokens)] == sample.tokens
    assert run(engine, requests())  # idle and serving again


def test_a_child_that_raises_or_dies_is_one_engine_error_line(feed_engine) -> None:  # type: ignore[no-untyped-def]
    _, feed, engine = feed_engine
    engine.submit(GenerationRequest((1, VOCAB + 50), 1, 4, Sampling(), NEVER))  # an id past the vocabulary
    with pytest.raises(EngineError) as raised:
        while engine.busy:
            engine.poll()
    line = str(raised.value)
    assert "\n" not in line and "sampler process failed: IndexError" in line, line
    with pytest.raises(EngineError, match="IndexError"):  # broken for good, the same line
        engine.submit(requests()[0])
    engine.close()
    assert not alive(engine.pid)

    second = HFProcessEngine(feed.shadow)
    try:
        feed.sync(second)
        second.submit(GenerationRequest((1, 2), 1, 400, Sampling(), NEVER))
        os.kill(second.pid, signal.SIGKILL)
        with pytest.raises(EngineError) as died:
            while second.busy:
                second.poll()
        assert str(died.value) == "rollout.engine=hf: the sampler process was killed by SIGKILL"
    finally:
        second.close()


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_an_engine_takes_a_process_started_before_the_policy_existed(method: str) -> None:
    """The process started first (as the trainer does before it loads its model: spawned, or forked from a
    fresh `treetrain train`) samples what the in-process engine samples once it has the shadow; it can be
    taken once, and one nobody took ends."""
    early = SamplerProcess(method)
    policy = tiny(0)  # built after the spawn: the process gets it only from the engine
    feed = WeightFeed(policy, version=0, shared=True)
    engine = HFProcessEngine(feed.shadow, process=early)
    try:
        feed.sync(engine)
        assert engine.pid == early.pid and name(engine.pid) == PROCESS_NAME and early.adopted
        assert 0 < engine.startup_seconds < 60, engine.startup_seconds
        got = run(engine, requests())
        assert gap(got, run(HFEngine(copy.deepcopy(policy), version=0), requests())) < FLOOR
        with pytest.raises(EngineError, match="already taken"):
            HFProcessEngine(feed.shadow, process=early)
        early.close()  # the engine's now: closing it from outside does nothing
        assert alive(engine.pid) and run(engine, requests(seed=3))
    finally:
        engine.close()
    assert not alive(early.pid)
    unused = SamplerProcess(method)
    unused.close()
    assert not alive(unused.pid)
    with pytest.raises(EngineError, match="already taken or has ended"):
        HFProcessEngine(feed.shadow, process=unused)


PARENT = """
import sys, time
from treetrain.rollout.engines.generation import GenerationRequest
from treetrain.rollout.engines.hf_process import HFProcessEngine
from treetrain.rollout.sampling import Sampling
from treetrain.rollout.weight_feed import WeightFeed
from test_hf_process import NEVER, tiny

feed = WeightFeed(tiny(0), version=0, shared=True)
engine = HFProcessEngine(feed.shadow)
feed.sync(engine)
engine.submit(GenerationRequest((1, 2, 3), 2, 100000, Sampling(), NEVER))
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_kill_9_of_the_parent_leaves_no_sampler_process() -> None:
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), *sys.path])}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert alive(pid) and name(pid) == PROCESS_NAME  # decoding a request that never ends
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert wait_for(lambda: not alive(pid), 30), "the sampler process outlived its parent"
    finally:
        parent.kill()
        parent.wait(30)
