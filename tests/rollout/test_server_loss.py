"""The vllm-server engine with several servers, against stand-ins on loopback: a server that dies mid-answer
is routed around (its samples go on elsewhere from the tokens they drew, and the loss is counted and named),
one that comes back is reloaded before it gets work, losing every server stops in one line, and the
servers' metrics steer where new trees go. `test_served_fleet.py` kills a real `vllm serve`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support.env_fixtures import tiny_model, tokenizer
from support.vllm_standin import EXPECTED, INFO, Standin, good, metrics_text, standins

from treetrain.cli.main import main
from treetrain.models.presets import tiny_model as preset
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


@pytest.mark.launch  # the run's environment workers
@pytest.mark.slow
def test_a_run_goes_on_without_a_lost_server_and_resumes_after_losing_all(
    server: Callable[..., str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Update 1 loses the first server and goes on; update 2 loses the other, which stops the run in one
    line; with both running again, `--resume` finishes it."""
    run = tmp_path / "run"
    die_at = {0: 1, 1: 2}  # server -> the rows of metrics.jsonl once which it dies at its next answer
    standins_: list[Standin] = []

    def answer(i: int) -> Callable[[dict], tuple[int, bytes]]:
        def completions(body: dict) -> tuple[int, bytes]:
            rows = (run / "metrics.jsonl").read_text().count("\n") if (run / "metrics.jsonl").exists() else 0
            if rows >= die_at[i]:
                standins_[i].cut_after = 0  # its headers, then the connection drops, as a killed server's
            return good(body)

        return completions

    standins_ += [
        Standin(
            completions=answer(i),
            model=preset("llama", len(tokenizer()), dtype=torch.float32),
            loads_weights=True,
        )
        for i in range(2)
    ]
    urls = [server(s) for s in standins_]
    sets = ["model.path=tiny-llama", "updates=3", "checkpoint_every=1", "rollout.engine=vllm-server",
            f"rollout.vllm.urls={json.dumps(urls)}", "rollout.groups_per_update=2", "rollout.fanout.root=2",
            "rollout.episode.max_turn_tokens=4", "rollout.episode.max_episode_tokens=512"]  # fmt: skip
    argv = ["train", "--run-dir", str(run), "--no-progress", *(a for kv in sets for a in ("--set", kv))]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("every server of rollout.vllm.urls is lost: start them again and "
                                            "continue with --resume"), err  # fmt: skip
    assert all(u in err for u in urls)
    for s in standins_:  # both started again
        s.dead, s.cut_after, s.version = False, None, "default"
    die_at.update({0: 99, 1: 99})
    assert main([*argv, "--resume"]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [0, 1, 2]
    assert [r["servers_lost"] for r in rows] == [0, 1, 0]
    (first, second) = rows[1]["servers"]
    assert first[0] == urls[0] and second[0] == urls[1] and first[1] >= 1 and second[1] > first[1]


def test_queue_times_are_read_once_the_engine_falls_idle(server: Callable[..., str], tmp_path: Path) -> None:
    """The histogram grows as requests end, after the reads made as they were sent: the read made when the
    engine falls idle brings the rollout's last queue times into its stats."""
    answered = Standin(metrics=metrics_text())

    def completions(body: dict) -> tuple[int, bytes]:
        done = len(answered.prompts)
        answered.metrics = metrics_text(queued=done, queue_seconds=0.5 * done)  # as vLLM counts it at the end
        return good(body)

    answered.completions = completions
    engine = _engine([server(answered), server(Standin())], tmp_path)
    for g in range(3):
        engine.submit(_request(f"g{g}", n=1))
    _drain(engine)
    first = engine.stats.servers[0]
    assert first.requests >= 1 and (first.queued, first.queue_seconds) == (
        first.requests,
        0.5 * first.requests,
    )
