"""The vllm-server engine against servers that misbehave (stand-ins on loopback speaking the completions
protocol badly), and its routing: one line naming the URL and the fault, and no tree file written half."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.env_fixtures import FixedTurnsEnv, tiny_model, tokenizer

from envs import EpisodeLimits, WrapperConfig
from treetrain.errors import TreetrainError
from treetrain.rollout import FanOut, RolloutConfig, SamplerConfig, Sampling, rollout_trees
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import EngineError, GenerationRequest
from treetrain.rollout.engines.vllm_server import VLLMServerEngine, route

MODELS = {"object": "list", "data": [{"id": "demo", "object": "model"}]}
Answer = Callable[[dict], tuple[int, bytes]]


def _good(body: dict) -> tuple[int, bytes]:
    end = body["stop_token_ids"][0]
    choices = [
        {
            "index": i,
            "token_ids": [7, end],
            "logprobs": {"token_logprobs": [-0.5, -0.25]},
            "finish_reason": "stop",
        }
        for i in range(body["n"])
    ]
    usage = {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": 3}}
    return 200, json.dumps({"choices": choices, "usage": usage}).encode()


class _Server(ThreadingHTTPServer):
    """Joins its handler threads on close (a slow answer must not outlive its test), and keeps quiet when
    the client has hung up on one (the timeout test does)."""

    daemon_threads = False
    block_on_close = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Callable[[Answer], str]]:
    """Start a stand-in server answering /v1/completions with the given function; yields a starter."""
    servers: list[ThreadingHTTPServer] = []

    def start(answer: Answer) -> str:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, json.dumps(MODELS).encode())

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(*answer(body) if self.path == "/v1/completions" else (200, b""))

        srv = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _engine(urls: list[str], tmp_path: Path, timeout: float = 5.0) -> VLLMServerEngine:
    return VLLMServerEngine(
        VLLMSettings(urls=tuple(urls), request_timeout_s=timeout), weights_dir=tmp_path / "w"
    )


def _rollout(engine: VLLMServerEngine, tmp_path: Path) -> object:
    config = RolloutConfig(
        FanOut(root=2),
        SamplerConfig(Sampling()),
        WrapperConfig(EpisodeLimits(max_turns=2, max_turn_tokens=4)),
    )
    return rollout_trees(
        tiny_model(), tokenizer(), FixedTurnsEnv, [0, 1], tmp_path / "run", config, engine=engine
    )


def test_a_well_behaved_server_grows_the_trees(server: Callable[[Answer], str], tmp_path: Path) -> None:
    engine = _engine([server(_good)], tmp_path)
    result = _rollout(engine, tmp_path)
    assert len(result.trees) == 2  # type: ignore[attr-defined]
    assert engine.stats.cached_tokens == 3 * engine.stats.requests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_that_is_down_is_named_at_start(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(EngineError, match=rf"^vllm-server {url}/v1/models: cannot connect: .*refused"):
        _engine([url], tmp_path)


@pytest.mark.parametrize(
    ("answer", "fault"),
    [
        (lambda body: (200, b"{not json"), "the answer is not JSON"),
        (lambda body: (500, b"engine exploded"), "HTTP 500 .*engine exploded"),
        (lambda body: (200, json.dumps({"choices": [{"index": 0}]}).encode()), "outside the protocol"),
        (lambda body: (200, json.dumps({"choices": [{"index": 0, "token_ids": [1, "x"], "logprobs": {"token_logprobs": [0, 0]}}]}).encode()), "outside the protocol"),
        (lambda body: (200, json.dumps({"choices": []}).encode()), "0 samples for a request of n=2"),
        (lambda body: (time.sleep(2), _good(body))[1], "no answer within 1s"),
    ],
)  # fmt: skip
def test_a_misbehaving_server_stops_the_rollout_in_one_line(
    server: Callable[[Answer], str], tmp_path: Path, answer: Answer, fault: str
) -> None:
    url = server(answer)
    with pytest.raises(EngineError) as caught:
        _rollout(_engine([url], tmp_path, timeout=1.0), tmp_path)
    line = str(caught.value)
    assert "\n" not in line and isinstance(caught.value, TreetrainError)
    assert line.startswith(f"vllm-server {url}/v1/completions: ") and __import__("re").search(fault, line)
    assert not list(
        (tmp_path / "run" / "trees").glob("*.msgpack")
    )  # nothing half: no tree without its answers


def test_every_request_of_a_tree_goes_to_one_server(server: Callable[[Answer], str], tmp_path: Path) -> None:
    seen: dict[str, list[int]] = {}

    def recorder(name: str) -> Answer:
        def answer(body: dict) -> tuple[int, bytes]:
            seen.setdefault(name, []).append(body["prompt"][-1])
            return _good(body)

        return answer

    urls = [server(recorder("a")), server(recorder("b"))]
    engine = _engine(urls, tmp_path)
    groups = [f"task-{i}" for i in range(8)]
    for i, g in enumerate(groups):
        for turn in range(3):  # the last prompt token says which tree a request belongs to
            engine.submit(GenerationRequest((1, 2, 3 + turn, 10 + i), 1, 4, Sampling(), ((2,),), group=g))
    while engine.busy:
        engine.poll()
    assert sum(len(v) for v in seen.values()) == 24
    trees = {name: {t - 10 for t in tokens} for name, tokens in seen.items()}
    assert set(trees) == {"a", "b"} and not trees["a"] & trees["b"]  # each tree on one server, both used
    assert all(route(g, 2) == (0 if i in trees["a"] else 1) for i, g in enumerate(groups))


def test_bad_urls_are_refused_at_load() -> None:
    for bad in ["localhost:8000", "ftp://x", "http://", "http://h:0", "http://h/?q=1"]:
        with pytest.raises(TreetrainError, match=r"^urls: "):
            VLLMSettings(urls=(bad,))
    with pytest.raises(TreetrainError, match="twice"):
        VLLMSettings(urls=("http://a:1", "http://a:1"))
