"""Stand-ins for `vllm serve` on loopback: they speak vLLM's protocol (or break it on purpose), so the
vllm-server engine's checks, routing and failure handling are tested without starting vLLM. A stand-in can
also fall silent (`dead`: it drops every connection, as a killed server's port does) or die mid-stream
(`cut_after` events of one answer, then the connection drops)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from treetrain.rollout.engines.server_checks import Expected

MODELS = {
    "object": "list",
    "data": [{"id": "demo", "object": "model", "root": "/ckpt/demo", "max_model_len": 4096}],
}
INFO: dict[str, Any] = {
    "model_config": {"dtype": "torch.float32", "logprobs_mode": "processed_logprobs", "max_model_len": 4096},
    "cache_config": {"enable_prefix_caching": True},
    "scheduler_config": {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 128,
    },
    "device_config": {"device": "cpu"},
}
EXPECTED = Expected(path="/ckpt/demo", dtype="float32", max_model_len=64)
Answer = Callable[[dict], tuple[int, bytes]]


def good(body: dict) -> tuple[int, bytes]:
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


def reload_answer(body: dict) -> tuple[int, bytes]:
    """vLLM's answer to a well-formed reload of a directory of safetensors; a 400 to anything else."""
    path = Path((body.get("kwargs") or {}).get("weights_path", "/nonexistent"))
    if body.get("method") != "reload_weights" or not list(path.glob("*.safetensors")):
        return 400, json.dumps({"detail": f"bad reload body {body}"}).encode()
    return 200, json.dumps({"results": [None]}).encode()


def as_events(data: bytes) -> bytes:
    """A whole completions answer as vLLM streams it: an event per sample token, then the usage, then
    `[DONE]` (an answer that is not one is sent as it is, for the client to refuse)."""
    try:
        answer = json.loads(data)
        events = []
        for choice in answer["choices"]:
            ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            for k, (t, lp) in enumerate(zip(ids, lps)):
                last = k == len(ids) - 1
                events.append({"choices": [{"index": choice["index"], "token_ids": [t],
                               "logprobs": {"token_logprobs": [lp]},
                               "finish_reason": choice["finish_reason"] if last else None}]})  # fmt: skip
        events.append({"choices": [], "usage": answer.get("usage")})
    except (ValueError, KeyError, TypeError):
        return data
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@dataclass
class Standin:
    """What a stand-in answers: `completions` for sampling, and vLLM's dev endpoints (each overridable in
    `posts`). Nothing is answered 200 that vLLM would not: an unknown path is a 404."""

    completions: Answer = good
    info: dict = field(default_factory=lambda: INFO)
    posts: dict[str, Answer] = field(default_factory=dict)
    models: dict = field(default_factory=lambda: MODELS)
    model: Any = None
    """Answers the weight probe (`prompt_logprobs`) with this model's logprobs."""
    version: str = "default"
    reloads: list[dict] = field(default_factory=list)
    metrics: str = ""
    """What `GET /metrics` answers (404 when empty)."""
    dead: bool = False
    """Drop every connection without an answer."""
    cut_after: int | None = None
    """Die in the middle of the next streamed answer: send this many of its events, then drop the
    connection and stay `dead`."""
    prompts: list[list[int]] = field(default_factory=list)
    """The prompt of every completions request, in order."""
    calls: list[str] = field(default_factory=list)
    """The path of every POST answered, in order."""
    loads_weights: bool = False
    """Load each reload's safetensors into `model`, as vLLM does (else `model` keeps its weights, as a
    server that never received them)."""

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        self.calls.append(path)
        if path in self.posts:
            return self.posts[path](body)
        if path == "/v1/completions":
            if "prompt_logprobs" in body:
                return self._probe(body)
            self.prompts.append(body["prompt"])
            code, data = self.completions(body)
            return (code, as_events(data)) if body.get("stream") and code == 200 else (code, data)
        if path == "/collective_rpc":
            self.reloads.append(body)
            code, data = reload_answer(body)
            if code == 200 and self.loads_weights:
                self._load(Path(body["kwargs"]["weights_path"]))
            return code, data
        if path == "/reset_prefix_cache":
            return 200, json.dumps({"success": True}).encode()
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, json.dumps({"success": True, "new_version": self.version}).encode()
        return 404, b'{"detail": "Not Found"}'

    def get(self, path: str) -> tuple[int, bytes]:
        if path == "/v1/models":
            return 200, json.dumps(self.models).encode()
        if path.startswith("/server_info") and self.info:
            return 200, json.dumps({"vllm_config": self.info}).encode()
        if path == "/metrics" and self.metrics:
            return 200, self.metrics.encode()
        if path == "/weight_info":
            return 200, json.dumps({"weight_version": self.version}).encode()
        return 404, b'{"detail": "Not Found"}'

    def _load(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
        _, unexpected = self.model.load_state_dict(state, strict=False)  # a tied head is not in the files
        assert not unexpected, unexpected

    def _probe(self, body: dict) -> tuple[int, bytes]:
        tokens = body["prompt"]
        with torch.no_grad():
            logp = self.model(torch.tensor([tokens])).logits[0].log_softmax(-1)
        entries = [None] + [{str(t): {"logprob": float(logp[i, t])}} for i, t in enumerate(tokens[1:])]
        return 200, json.dumps({"choices": [{"index": 0, "prompt_logprobs": entries}]}).encode()


class _Server(ThreadingHTTPServer):
    """Joins its handler threads on close (a slow answer must not outlive its test), and keeps quiet when
    the client has hung up on one (the timeout test does)."""

    daemon_threads = False
    block_on_close = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


@contextlib.contextmanager
def standins() -> Iterator[Callable[..., str]]:
    """A function that starts a stand-in server (a `Standin`, or one answering /v1/completions with the
    given function) and returns its URL; every one started is shut down at the end."""
    servers: list[ThreadingHTTPServer] = []

    def start(answer: Answer | Standin = good) -> str:
        standin = answer if isinstance(answer, Standin) else Standin(completions=answer)

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
                if standin.dead:
                    self.close_connection = True
                    return
                self._send(*standin.get(self.path))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if standin.dead:
                    self.close_connection = True
                    return
                code, data = standin.post(self.path, body)
                cut = standin.cut_after
                if cut is not None and body.get("stream") and self.path == "/v1/completions":
                    standin.dead, standin.cut_after = True, None
                    self.send_response(code)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    self.wfile.write(b"".join(e + b"\n\n" for e in data.split(b"\n\n")[:cut]))
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self._send(code, data)

        srv = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def metrics_text(
    running: float = 0, waiting: float = 0, kv: float = 0.0, queue_seconds: float = 0.0, queued: int = 0
) -> str:
    """A `GET /metrics` answer shaped as vLLM's (help and type lines, an engine and a model label, the
    queue-time histogram's buckets, and metrics the router does not read)."""
    labels = 'engine="0",model_name="demo"'
    return "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
        "# TYPE vllm:num_requests_waiting_by_reason gauge",
        f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} {float(waiting)}',
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
        "# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.",
        "# TYPE vllm:request_queue_time_seconds histogram",
        f'vllm:request_queue_time_seconds_bucket{{{labels},le="0.3"}} {float(queued)}',
        f'vllm:request_queue_time_seconds_bucket{{{labels},le="+Inf"}} {float(queued)}',
        f"vllm:request_queue_time_seconds_count{{{labels}}} {float(queued)}",
        f"vllm:request_queue_time_seconds_sum{{{labels}}} {queue_seconds}",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{labels}}} 1234.0",
        "",
    ])  # fmt: skip
