"""Stand-in vLLM servers on loopback for the vllm-server engine's tests: each speaks vLLM's HTTP protocol
(completions, the dev-mode reload and weight-version endpoints, /server_info) as a `Standin` says, well or
badly, so a test can make one endpoint misbehave and check the engine names the URL and the fault.

Nothing is answered 200 that vLLM would not: an unknown path is a 404. `tests/rollout/test_served_engine.py`
meets a real `vllm serve` instead.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


def good_completions(body: dict) -> tuple[int, bytes]:
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


def good_reload(body: dict) -> tuple[int, bytes]:
    """vLLM's answer to a well-formed reload of a directory of safetensors; a 400 to anything else."""
    path = Path((body.get("kwargs") or {}).get("weights_path", "/nonexistent"))
    if body.get("method") != "reload_weights" or not list(path.glob("*.safetensors")):
        return 400, json.dumps({"detail": f"bad reload body {body}"}).encode()
    return 200, json.dumps({"results": [None]}).encode()


@dataclass
class Standin:
    """What a stand-in answers: `completions` for sampling, and vLLM's dev endpoints (each overridable in
    `posts`). Nothing is answered 200 that vLLM would not: an unknown path is a 404."""

    completions: Answer = good_completions
    info: dict = field(default_factory=lambda: INFO)
    posts: dict[str, Answer] = field(default_factory=dict)
    models: dict = field(default_factory=lambda: MODELS)
    model: Any = None
    """Answers the weight probe (`prompt_logprobs`) with this model's logprobs."""
    version: str = "default"
    reloads: list[dict] = field(default_factory=list)

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        if path in self.posts:
            return self.posts[path](body)
        if path == "/v1/completions":
            return self._probe(body) if "prompt_logprobs" in body else self.completions(body)
        if path == "/collective_rpc":
            self.reloads.append(body)
            return good_reload(body)
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
        if path == "/weight_info":
            return 200, json.dumps({"weight_version": self.version}).encode()
        return 404, b'{"detail": "Not Found"}'

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


@contextmanager
def standin_servers() -> Iterator[Callable[..., str]]:
    """Start stand-in servers (a `Standin`, or one answering /v1/completions with the given function) on
    loopback; each is shut down, its handler threads joined, when the block ends."""
    servers: list[ThreadingHTTPServer] = []

    def start(answer: Answer | Standin = good_completions) -> str:
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
                self._send(*standin.get(self.path))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(*standin.post(self.path, body))

        srv = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    try:
        yield start
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
