"""The vllm-server engine against a real `vllm serve` (the docs' command, started once per session): its
start-up checks read the real server's settings, a reload reaches the served weights (and a skipped one
shows as a large sampler/trainer gap, and is caught by the probe), and a server reloaded by someone else
stops the rollout."""

from __future__ import annotations

import copy
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from support.interrupted import go_on, version_gaps
from transformers import AutoTokenizer, LlamaForCausalLM

from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import Draft, EngineError, GenerationRequest, GenerationResult
from treetrain.rollout.engines.server_checks import Expected
from treetrain.rollout.engines.vllm_server import VLLMServerEngine
from treetrain.rollout.sampling import Sampling
from treetrain.train.models import WIDE_DEMO_MODEL

pytestmark = pytest.mark.slow
GAP = 1e-4
"""|vLLM - trainer| logprob of a sampled token on the same float32 weights (measured 4e-6 to 6e-6)."""
SKIPPED = 1e-2
"""Smallest gap the negative control must show: one AdamW step at lr 1e-3 the server never received
(measured 9.3)."""


def _engine(url: str, tmp_path: Path, **expected: Any) -> VLLMServerEngine:
    want = Expected(**{"path": str(WIDE_DEMO_MODEL), "dtype": "float32", "max_model_len": 1024, **expected})
    return VLLMServerEngine(VLLMSettings(urls=(url,)), weights_dir=tmp_path / "engine-weights", expected=want)


def _context() -> tuple[int, ...]:
    tok = AutoTokenizer.from_pretrained(WIDE_DEMO_MODEL)
    return tuple(tok.encode("<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n"))


def _sample(engine: VLLMServerEngine, context: tuple[int, ...]) -> GenerationResult:
    engine.submit(GenerationRequest(context, 4, 24, Sampling(), ((2,),), seed=5, group="probe"))
    results: list[GenerationResult] = []
    while engine.busy:
        results += engine.poll()
    (result,) = results
    return result


def _gap(engine: VLLMServerEngine, model: Any, context: tuple[int, ...]) -> float:
    """Largest |server - trainer| logprob over four samples of `context`."""
    gaps = []
    for completion in _sample(engine, context).completions:
        ids = torch.tensor([context + completion.tokens])
        with torch.no_grad():
            logp = model(ids).logits[0, len(context) - 1 : -1].log_softmax(-1)
        own = logp.gather(-1, torch.tensor(completion.tokens)[:, None])[:, 0]
        gaps.append(float((own - torch.tensor(completion.logprobs)).abs().max()))
    return max(gaps)


def _step(model: Any, context: tuple[int, ...], tokens: tuple[int, ...]) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(torch.tensor([context + tokens])).logits
    logits[0, len(context) - 1 : -1].log_softmax(-1).gather(
        -1, torch.tensor(tokens)[:, None]
    ).sum().backward()
    optimizer.step()
    model.zero_grad()


def test_a_reload_reaches_the_server_and_a_skipped_one_shows(vllm_server: str, tmp_path: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    context = _context()
    engine = _engine(vllm_server, tmp_path)
    engine.sync_weights(model, 0)
    synced = _gap(engine, model, context)
    _step(model, context, _sample(engine, context).completions[0].tokens)

    skipped = _gap(engine, model, context)  # negative control: the step never reached the server
    original = engine.weights._reload
    engine.weights._reload = lambda *args: None  # type: ignore[method-assign]  # a reload that does nothing
    with pytest.raises(
        EngineError, match=r"weight probe\): its logprobs differ .* does not serve the weights"
    ):
        engine.sync_weights(model, 1)
    engine.weights._reload = original  # type: ignore[method-assign]

    engine.sync_weights(model, 1)
    resynced = _gap(engine, model, context)
    assert synced < GAP and resynced < GAP, (synced, resynced)
    assert skipped > SKIPPED, skipped
    files = list((tmp_path / "engine-weights" / "current").iterdir())
    assert files and all(f.stat().st_mode & 0o777 == 0o644 for f in files)  # another user's server reads them
    assert (tmp_path / "engine-weights" / "current").stat().st_mode & 0o777 == 0o755


def test_a_server_reloaded_by_someone_else_stops_the_rollout(vllm_server: str, tmp_path: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    engine = _engine(vllm_server, tmp_path)
    engine.sync_weights(model, 0)
    engine.check_versions("now")  # its own label passes
    body = json.dumps({"new_version": "another-run@7"}).encode()
    request = urllib.request.Request(
        vllm_server + "/update_weight_version", body, {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=30).close()
    with pytest.raises(EngineError, match=r"weight version is 'another-run@7'.*reloaded by someone else"):
        _sample(engine, _context())  # noticed as soon as the engine falls idle


@pytest.mark.parametrize(
    ("expected", "flag"),
    [({"dtype": "bfloat16"}, "--dtype bfloat16"), ({"max_model_len": 4096}, "--max-model-len 4096")],
)
def test_a_server_started_with_other_flags_is_refused_naming_the_flag(
    vllm_server: str, tmp_path: Path, expected: dict[str, Any], flag: str
) -> None:
    with pytest.raises(EngineError) as caught:
        _engine(vllm_server, tmp_path, **expected)
    line = str(caught.value)
    assert line.startswith(f"vllm-server {vllm_server} (serving treetrain/assets/demo_model_wide): ")
    assert line.endswith(flag) or f"{flag} " in line, line
    assert "\n" not in line


def test_a_streamed_request_interrupted_for_new_weights_goes_on_under_them(
    vllm_server: str, tmp_path: Path
) -> None:
    """Abort and resubmit against the real server: the streamed tokens drawn before the interrupt are the
    old weights' (scored by the trainer's old model), the rest the new weights'."""
    old = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    new = copy.deepcopy(old)
    context, stop = _context(), ((511, 512, 513),)  # the server stops on none: samples run to their budget
    want = Expected(path=str(WIDE_DEMO_MODEL), dtype="float32", max_model_len=1024)
    engine = VLLMServerEngine(
        VLLMSettings(urls=(vllm_server,)), weights_dir=tmp_path / "engine-weights", expected=want, stream=True
    )
    engine.sync_weights(old, 0)
    engine.submit(GenerationRequest(context, 2, 400, Sampling(), stop, seed=5, group="probe"))
    started = time.monotonic()
    while engine.busy and time.monotonic() - started < 0.5:
        assert engine.poll() == []
    (stopped,) = engine.interrupt()
    assert not engine.busy
    drafts = [d for d in stopped.samples if isinstance(d, Draft) and d.tokens]
    assert drafts, stopped.samples
    _step(new, context, drafts[0].tokens)
    engine.sync_weights(new, 1)
    try:
        whole = go_on(engine, context, drafts, 400, stop)
    finally:
        engine.sync_weights(old, 2)
        engine.close()
    for sample, draft in zip(whole, drafts):
        assert len(sample.tokens) == 400
        assert sample.version_runs == ((len(draft.tokens), 0), (400 - len(draft.tokens), 1))
        own, other = version_gaps(context, sample, old, new)
        assert own < GAP and other > SKIPPED  # other: the versions swapped (negative control)


def test_published_versions_reach_the_server_and_the_ones_it_no_longer_needs_go(
    vllm_server: str, tmp_path: Path
) -> None:
    """An asynchronous run's feed (`treetrain.rollout.served_feed`): the training thread publishes each
    version to disk, the sampler's thread has the server load the newest, and nothing else is kept."""
    from treetrain.rollout.served_feed import ServedFeed

    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    context = _context()
    engine = _engine(vllm_server, tmp_path)
    published = tmp_path / "engine-weights" / "published"
    feed = ServedFeed(tmp_path / "engine-weights", None, version=0, writes=True)
    feed.publish(model, 0)
    feed.sync(engine)
    first = _gap(engine, model, context)
    _step(model, context, _sample(engine, context).completions[0].tokens)
    feed.publish(model, 1)
    assert feed.due(engine.version) and sorted(p.name for p in published.iterdir()) == ["v0", "v1"]
    unloaded = _gap(engine, model, context)  # negative control: published, not yet loaded
    _step(model, context, _sample(engine, context).completions[0].tokens)
    feed.publish(model, 2)  # version 1 was never taken: it goes; version 0 is what the server holds
    assert sorted(p.name for p in published.iterdir()) == ["v0", "v2"]
    feed.sync(engine)
    assert engine.version == 2 and sorted(p.name for p in published.iterdir()) == ["v2"]
    second = _gap(engine, model, context)
    assert first < GAP and second < GAP and unloaded > SKIPPED, (first, second, unloaded)
    assert engine.stats.weight_syncs == 2 and engine.stats.sync_bytes == 2 * feed.newest.size
    follower = ServedFeed(tmp_path / "follower", None, version=0, writes=False)
    follower.publish(model, 3)  # runs what the write runs, writes nothing
    assert follower.version == 3 and not (tmp_path / "follower").exists()
    engine.close()
    assert not (tmp_path / "engine-weights").exists()
