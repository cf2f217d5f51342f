"""The vllm-server engine with several servers, against stand-ins on loopback: a server that dies mid-answer
is routed around (its samples go on elsewhere from the tokens they drew, and the loss is counted and named),
one that comes back is reloaded before it gets work, losing every server stops in one line, and the
servers' metrics steer where new trees go. `test_served_fleet.py` kills a real `vllm serve`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.env_fixtures import tiny_model
from support.vllm_standin import EXPECTED, INFO, Standin, metrics_text, standins

from treetrain.rollout.engines import server_fleet
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import EngineError, GenerationRequest, GenerationResult
from treetrain.rollout.engines.vllm_server import VLLMServerEngine
from treetrain.rollout.sampling import Sampling

END = 2


@pytest.fixture
def server() -> Iterator[Callable[..., str]]:
    with standins() as start:
        yield start


def _engine(urls: list[str], tmp_path: Path) -> VLLMServerEngine:
    settings = VLLMSettings(urls=tuple(urls), request_timeout_s=5.0)
    return VLLMServerEngine(settings, weights_dir=tmp_path / "w", expected=EXPECTED)


def _request(group: str, n: int = 2) -> GenerationRequest:
    return GenerationRequest((1, 5, 9), n, 8, Sampling(), ((END,),), seed=3, group=group)


def _drain(engine: VLLMServerEngine) -> list[GenerationResult]:
    results: list[GenerationResult] = []
    while engine.busy:
        results += engine.poll()
    return results


def test_a_server_lost_mid_answer_is_routed_around(
    server: Callable[..., str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dying, other = Standin(cut_after=1), Standin()  # the first event (sample 0's first token), then gone
    urls = [server(dying), server(other)]
    engine = _engine(urls, tmp_path)
    with caplog.at_level("WARNING"):
        engine.submit(_request("g"))  # a new tree: the first server, all idle
        (result,) = _drain(engine)
    # sample 0 goes on from its token 7; sample 1, which drew nothing, is sent again as it was
    assert sorted(other.prompts) == [[1, 5, 9], [1, 5, 9, 7]]
    tokens = sorted((c.tokens, c.logprobs) for c in result.completions)
    assert tokens == [((7, END), (-0.5, -0.25)), ((7, 7, END), (-0.5, -0.5, -0.25))]
    assert all(c.version == 0 and c.stopped for c in result.completions)
    (line,) = [r.getMessage() for r in caplog.records if "is lost" in r.getMessage()]
    assert line.startswith(f"vllm-server {urls[0]} is lost (") and "1 of 2 servers left" in line, line
    assert engine.stats.servers_lost == 1
    per_server = {s.url: (s.requests, s.samples) for s in engine.stats.servers}
    assert per_server == {urls[0]: (1, 2), urls[1]: (2, 2)}
    engine.submit(_request("g"))  # the tree's next request: to the server that is left
    _drain(engine)
    assert len(other.prompts) == 3 and dying.prompts == [[1, 5, 9]]


def test_a_server_that_comes_back_is_reloaded_before_it_gets_work(
    server: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(server_fleet, "PROBE_EVERY_S", 0.0)
    model = tiny_model()
    dying, other = Standin(model=model), Standin(model=model)
    engine = _engine([server(dying), server(other)], tmp_path)
    engine.sync_weights(model, 1)
    dying.dead = True
    engine.submit(_request("g"))
    _drain(engine)
    dying.version, dying.dead = "default", False  # restarted: the weights it started with
    with caplog.at_level("WARNING"):
        engine.poll()  # the scheduler polls on: the probe is due
        engine.submit(_request("h"))  # a new tree, both idle: the first server, now that it is back
        _drain(engine)
    assert dying.version == engine.label
    load = ["/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/v1/completions"]  # + probe
    assert dying.calls == [*load, *load, "/v1/completions"]  # the sync; once back, the reload; then work
    assert any(f"{engine.urls[0]} is back, reloaded" in r.getMessage() for r in caplog.records)
    assert engine.stats.servers_lost == 1


def test_a_server_that_comes_back_unfit_stays_out(
    server: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(server_fleet, "PROBE_EVERY_S", 0.0)
    model = tiny_model()
    dying, other = Standin(model=model), Standin(model=model)
    engine = _engine([server(dying), server(other)], tmp_path)
    engine.sync_weights(model, 1)
    dying.dead = True
    engine.submit(_request("g"))
    _drain(engine)
    dying.info = {**INFO, "model_config": {**INFO["model_config"], "dtype": "torch.bfloat16"}}
    dying.dead = False  # back, started with other flags
    with caplog.at_level("WARNING"):
        engine.poll()
        engine.submit(_request("h"))
        _drain(engine)
    assert "/collective_rpc" not in dying.calls[-3:] and engine.fleet.alive == (1,)
    assert any("answers again but stays out of this run" in r.getMessage() and "--dtype float32" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_losing_every_server_stops_in_one_line(server: Callable[..., str], tmp_path: Path) -> None:
    standins_ = [Standin(), Standin()]
    urls = [server(s) for s in standins_]
    engine = _engine(urls, tmp_path)
    for s in standins_:
        s.dead = True
    engine.submit(_request("g"))
    with pytest.raises(EngineError) as caught:
        _drain(engine)
    line = str(caught.value)
    assert "\n" not in line and all(u in line for u in urls), line
    assert line.endswith(
        "every server of rollout.vllm.urls is lost: start them again and continue with --resume"
    )
    assert engine.stats.servers_lost == 2
    assert not engine.busy


def test_new_trees_go_where_the_metrics_say_there_is_room(server: Callable[..., str], tmp_path: Path) -> None:
    full, free = Standin(metrics=metrics_text(running=1, kv=0.95)), Standin(metrics=metrics_text(running=1))
    engine = _engine([server(full), server(free)], tmp_path)
    for g in range(4):
        engine.submit(_request(f"g{g}", n=1))
        _drain(engine)
    assert len(full.prompts) == 0 and len(free.prompts) == 4
    full.metrics = metrics_text(running=0, queue_seconds=3.0, queued=2)  # the negative control: room again
    free.metrics = metrics_text(running=6, kv=0.5)
    engine.fleet.servers[0].read_at = engine.fleet.servers[1].read_at = -1e9  # read again now
    engine.submit(_request("new", n=1))
    _drain(engine)
    assert len(full.prompts) == 1
    assert dataclasses.asdict(engine.stats.servers[0])["queued"] == 2
