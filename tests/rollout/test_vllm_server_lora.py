"""LoRA through `vllm serve`: each sync sends the adapter only (`POST /v1/load_lora_adapter` with a PEFT
directory that loads back into the trainer's policy), unloads the previous one, and requests name the
current adapter as their model; a server without runtime LoRA updating stops the run in one line that says
how to start it. Against a stand-in server on loopback (a real `vllm serve` is the vllm engine's job)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from support.env_fixtures import tiny_model

from treetrain.models.lora import apply_lora
from treetrain.models.lora_config import LoraSection
from treetrain.rollout import Sampling
from treetrain.rollout.engines.adapter_sync import lora_serving
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import EngineError, GenerationRequest
from treetrain.rollout.engines.vllm_server import VLLMServerEngine


@pytest.fixture
def stand_in() -> Iterator[tuple[str, list[tuple[str, dict[str, Any]]], dict[str, int]]]:
    """A loopback server that records every POST; `status['lora']` is what it answers adapter loads with."""
    calls: list[tuple[str, dict[str, Any]]] = []
    status = {"lora": 200}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: dict[str, Any]) -> None:
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self._send(200, {"data": [{"id": "base"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            calls.append((self.path, body))
            if self.path == "/v1/completions":
                choices = [{"index": i, "token_ids": [7, 2], "logprobs": {"token_logprobs": [-0.5, -0.1]},
                            "finish_reason": "stop"} for i in range(body["n"])]  # fmt: skip
                self._send(200, {"choices": choices, "usage": {}})
            elif self.path == "/v1/load_lora_adapter" and status["lora"] != 200:
                self._send(status["lora"], {"error": "runtime LoRA updating is off"})
            else:
                self._send(200, {})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", calls, status
    server.shutdown()
    server.server_close()


def _policy() -> Any:
    model = apply_lora(tiny_model(dtype=torch.float32), LoraSection(r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3)  # as after training
    return model


def test_a_sync_sends_the_adapter_and_requests_name_it(stand_in: Any, tmp_path: Path) -> None:
    url, calls, _ = stand_in
    model = _policy()
    engine = VLLMServerEngine(VLLMSettings(urls=(url,)), weights_dir=tmp_path, lora=lora_serving(model))
    try:
        engine.sync_weights(model, 1)
        engine.sync_weights(model, 2)
        engine.submit(GenerationRequest((1, 2, 3), 1, 4, Sampling(temperature=1.0), ((2,),)))
        while engine.busy:
            engine.poll()
    finally:
        engine.close()
    paths = [p for p, _ in calls]
    assert "/collective_rpc" not in paths  # the base weights are never sent
    loads = [b for p, b in calls if p == "/v1/load_lora_adapter"]
    assert [b["lora_name"] for b in loads] == ["treetrain-v1", "treetrain-v2"]
    assert [b for p, b in calls if p == "/v1/unload_lora_adapter"] == [{"lora_name": "treetrain-v1"}]
    assert [b["model"] for p, b in calls if p == "/v1/completions"] == ["treetrain-v2"]
    served = Path(loads[-1]["lora_path"])
    assert not Path(loads[0]["lora_path"]).exists()  # the previous version's files are gone
    loaded = PeftModel.from_pretrained(tiny_model(dtype=torch.float32), str(served))
    ids = torch.tensor([[1, 5, 9, 40]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert engine.stats.sync_bytes < sum(p.numel() * 4 for p in model.get_base_model().parameters())


def test_a_server_without_runtime_lora_says_how_to_start_it(stand_in: Any, tmp_path: Path) -> None:
    url, _, status = stand_in
    status["lora"] = 404
    model = _policy()
    engine = VLLMServerEngine(VLLMSettings(urls=(url,)), weights_dir=tmp_path, lora=lora_serving(model))
    try:
        with pytest.raises(EngineError, match=r"HTTP 404.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            engine.sync_weights(model, 1)
    finally:
        engine.close()
