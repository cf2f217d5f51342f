"""`rollout.vllm.weight_sync: gloo`: weights streamed into a real `vllm serve` (the docs' command, started
once per session) through vLLM's weight-transfer API, against the file reload.

The chunk layout round-trips every dtype it carries, bit for bit. On the server, a streamed step reaches the
served weights (the sampler/trainer gap at float32 rounding), the served logprobs equal those after a file
reload of the same weights exactly, and a stream that leaves one tensor out is caught by the probe
(negative control). A server that cannot be reached fails alone, the others take the weights; a server
without the backend is refused at start, naming the flag; a chunk the server refuses ends the sync at once
in one line, and the next stream repairs the server."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from support.scripts import load_script
from transformers import LlamaForCausalLM

from treetrain.rollout.engines import served_stream
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import EngineError
from treetrain.rollout.engines.gloo_sender import chunk_layout, pack, unpack
from treetrain.rollout.engines.server_calls import ServerLostError
from treetrain.rollout.engines.server_checks import Expected, check_server
from treetrain.rollout.engines.vllm_server import VLLMServerEngine
from treetrain.train.models import WIDE_DEMO_MODEL

GAP = 1e-4
"""|vLLM - trainer| logprob on the same float32 weights (measured 4e-6 to 9e-6)."""
bench = load_script("bench/weight_sync.py", "bench_weight_sync")
WANT = Expected(path=str(WIDE_DEMO_MODEL), dtype="float32", max_model_len=1024)


def test_a_chunk_round_trips_every_dtype_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=gen).to(dtype)
        for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.bfloat16)
    ] + [torch.randn(7, generator=gen)[::2], torch.zeros(0, 4)]  # a strided view, an empty tensor
    buf = pack(tensors)
    names = [str(t.dtype).removeprefix("torch.") for t in tensors]
    back = unpack(buf.clone(), [list(t.shape) for t in tensors], names)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(tensors, back))
    offsets, size = chunk_layout([list(t.shape) for t in tensors], names)
    assert size == buf.numel() and all(at % 16 == 0 for at in offsets)
    for shapes, dtypes, why in (
        ([[2]], ["int64"], "dtype 'int64'"),
        ([[-1]], ["float32"], "not a list of sizes"),
        ([[2.5]], ["float32"], "not a list of sizes"),
    ):
        with pytest.raises(ValueError, match=why):
            chunk_layout(shapes, dtypes)


def _engine(url: str | tuple[str, ...], tmp_path: Path) -> VLLMServerEngine:
    urls = (url,) if isinstance(url, str) else url
    settings = VLLMSettings(urls=urls, weight_sync="gloo")
    return VLLMServerEngine(settings, weights_dir=tmp_path / "engine-weights", expected=WANT)


def _moved(seed: int) -> Any:
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def _served_logprobs(url: str, model: Any) -> list[float]:
    from treetrain.rollout.engines.server_checks import served_prompt_logprobs, trainer_probe

    tokens, _ = trainer_probe(model)
    body = {
        "model": "treetrain/assets/demo_model_wide",
        "prompt": tokens,
        "max_tokens": 1,
        "prompt_logprobs": 0,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return served_prompt_logprobs(json.loads(resp.read()), tokens)


def _gap(url: str, model: Any) -> float:
    from treetrain.rollout.engines.server_checks import trainer_probe

    _, own = trainer_probe(model)
    return max(abs(a - b) for a, b in zip(own, _served_logprobs(url, model)))


@pytest.mark.slow
def test_streamed_weights_are_the_file_reloads_and_a_missing_tensor_is_caught(
    vllm_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _moved(1)
    files = VLLMServerEngine(VLLMSettings(urls=(vllm_server,)), weights_dir=tmp_path / "files", expected=WANT)
    files.sync_weights(model, 0)
    through_files = _served_logprobs(vllm_server, model)
    files.close()

    engine = _engine(vllm_server, tmp_path)
    other = _moved(2)  # the server holds other weights before the stream
    engine.sync_weights(other, 0)
    assert _gap(vllm_server, other) < GAP and _gap(vllm_server, model) > 1e-2
    engine.sync_weights(model, 1)
    assert _served_logprobs(vllm_server, model) == through_files  # the same float32 weights, bit for bit
    assert engine.stats.sync_bytes >= 2 * sum(p.numel() * 4 for p in model.parameters())

    from treetrain.rollout.engines import weight_buckets

    every = weight_buckets.weight_buckets

    def without_one(model: Any, **kw: Any) -> Any:  # negative control: a stream that leaves one tensor out
        for bucket in every(model, **kw):
            yield [(n, t) for n, t in bucket if n != "model.layers.0.mlp.down_proj.weight"]

    monkeypatch.setattr(weight_buckets, "weight_buckets", without_one)
    with pytest.raises(EngineError, match=r"weight probe\): its logprobs differ"):
        engine.sync_weights(other, 2)
    monkeypatch.undo()
    engine.sync_weights(other, 3)
    assert _gap(vllm_server, other) < GAP
    engine.close()
    assert not (tmp_path / "engine-weights").exists()  # nothing was written


@pytest.mark.slow
def test_a_server_that_cannot_be_reached_fails_alone(vllm_server: str, tmp_path: Path) -> None:
    from support.ports import free_port

    engine = _engine(vllm_server, tmp_path)
    streamed = served_stream.StreamedWeights("127.0.0.1", 30.0)
    gone = f"http://127.0.0.1:{free_port()}"
    model = _moved(3)
    servers = {0: (vllm_server, engine.served[0]), 1: (gone, engine.served[0])}
    failed, sent = streamed.send(model, "probe@1", engine.weights, servers)
    assert list(failed) == [1] and isinstance(failed[1], ServerLostError), failed
    assert sent == streamed.senders[0].sent_bytes > 0 and 1 not in streamed.senders
    assert _gap(vllm_server, model) < GAP
    streamed.close()
    engine.close()


@pytest.mark.slow
def test_a_server_without_the_backend_is_refused_naming_the_flag(vllm_server: str) -> None:
    with pytest.raises(EngineError) as caught:
        check_server(vllm_server, WANT, 30.0, transfer="nccl")
    line = str(caught.value)
    assert "\n" not in line and "with the weight transfer backend 'treetrain_gloo'" in line
    assert """--weight-transfer-config '{"backend": "nccl"}'""" in line and "weight_sync=files" in line


@pytest.mark.slow
def test_the_benchmark_syncs_both_ways_into_the_server(vllm_server: str, tmp_path: Path) -> None:
    syncs = bench.run([vllm_server], 1, tmp_path)
    assert [s.method for s in syncs] == ["files", "gloo", "gloo", "files"]
    assert all(s.gap < GAP and s.sent > 0 for s in syncs), syncs
    lines = bench.report(syncs, 1, bench.weight_bytes(), "python bench/weight_sync.py").splitlines()
    assert lines[4].startswith("| files |") and lines[5].startswith("| gloo |")
    assert lines[-1].startswith("gloo/files sync seconds: ")


@pytest.mark.slow
def test_a_server_back_after_a_loss_takes_the_next_stream_before_work(
    vllm_server: str, tmp_path: Path
) -> None:
    engine = _engine(vllm_server, tmp_path)
    first, second = _moved(4), _moved(5)
    engine.sync_weights(first, 0)
    engine._lose(0, ServerLostError("dropped by the test"))
    engine.fleet.servers[0].probe_at = 0.0  # due for a probe now
    engine._recover()
    assert engine.fleet.alive == () and engine.streamed is not None and engine.streamed.returning == {0}
    assert _gap(vllm_server, first) < GAP  # still the old version: it gets no work yet
    engine.sync_weights(second, 1)
    assert engine.fleet.alive == (0,) and not engine.streamed.returning
    assert _gap(vllm_server, second) < GAP
    engine.close()


@pytest.mark.slow
def test_a_chunk_the_server_refuses_fails_the_sync_in_one_line_and_the_next_sync_repairs_it(
    vllm_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket the server cannot load (a tensor its model lacks) ends that sync with the server's answer in
    one line instead of waiting out the broadcast's timeout; the server stays usable, and the next complete
    stream brings it to the trainer's weights, half-loaded buckets included."""
    from treetrain.rollout.engines import weight_buckets

    engine = _engine(vllm_server, tmp_path)
    first, second = _moved(6), _moved(7)
    engine.sync_weights(first, 0)
    every = weight_buckets.weight_buckets

    def with_a_stranger(model: Any, **kw: Any) -> Any:
        for i, bucket in enumerate(every(model, **kw)):
            yield bucket if i else [*bucket, ("model.no_such_module.weight", torch.zeros(2, 2))]

    monkeypatch.setattr(weight_buckets, "weight_buckets", with_a_stranger)
    started = time.monotonic()
    with pytest.raises(EngineError) as caught:
        engine.sync_weights(second, 1)
    waited = time.monotonic() - started
    print(f"\nrefused chunk: {caught.value} ({waited:.1f} s)")
    assert "\n" not in str(caught.value) and vllm_server in str(caught.value)
    assert waited < 20  # the broadcast's wait ended with the refusal, not its timeout
    monkeypatch.undo()
    engine.sync_weights(second, 2)
    assert _gap(vllm_server, second) < GAP
    engine.close()
