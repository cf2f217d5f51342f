"""Every reload of a real `vllm serve` logs `RotaryEmbedding: Failed to load weights`, once, and it is
harmless: vLLM's in-place reload counts each layer's tensors, buffers included, and RotaryEmbedding's one
tensor is its `cos_sin_cache` buffer, computed from the config and in no checkpoint (vLLM's loaders skip
rotary names). With nothing loaded into it, vLLM puts the cache it had back (`_place_kernel_tensors` in
`vllm/model_executor/model_loader/reload/layerwise.py`) and warns.

The checks: a reload of treetrain's file warns for RotaryEmbedding alone, and a reload of the model's own
checkpoint warns for it too (so the file is not the cause; that checkpoint, tied embeddings saved once, also
warns for the LM head, which treetrain's file writes out); after it the served logprobs of a 300-token prompt are the
trainer's at every position, which a rotary table that changed would break (negative control: the trainer's
logprobs with its table at twice the frequencies differ). A file that misses real weights (layer 0's attention) is named
by the same warning for that layer: the check of which layers warn would catch it."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.served_checkpoint import write_weights
from treetrain.rollout.engines.server_checks import Expected, served_prompt_logprobs
from treetrain.rollout.engines.vllm_server import VLLMServerEngine
from treetrain.train.models import WIDE_DEMO_MODEL

pytestmark = pytest.mark.slow
GAP = 1e-4
"""|vLLM - trainer| logprob of a prompt token on the same float32 weights (measured under 1e-5)."""
OTHER_TABLE = 1e-2
"""Smallest gap the negative control must show: the trainer's rotary table at twice its frequencies."""
WARNING = re.compile(r"(\w+): Failed to load weights")


def _post(url: str, path: str, body: dict) -> object:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())


def _reload_warnings(url: str, log: Path, weights: Path) -> tuple[list[str], bool]:
    """Reload `weights` on the server: the layers its log then says failed to load (in order), and whether
    it listed parameters the file lacks."""
    start = log.stat().st_size
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}
    assert _post(url, "/collective_rpc", body) == {"results": [None]}
    deadline = time.monotonic() + 10
    while True:  # the engine core logs before it answers; its lines may reach the file a moment later
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        if WARNING.search(text) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return WARNING.findall(text), "were not loaded from checkpoint" in text


def _served(url: str, tokens: list[int]) -> torch.Tensor:
    """The server's logprob of each prompt token after the first."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0,
            "logprobs": 0}  # fmt: skip
    answer = _post(url, "/v1/completions", body)
    return torch.tensor(served_prompt_logprobs(answer, tokens), dtype=torch.float64)


def _own(model: LlamaForCausalLM, tokens: list[int], stride: int = 1) -> torch.Tensor:
    """The trainer's logprobs; `stride` 2 reads its rotary table at twice every frequency."""
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None] * stride
    with torch.no_grad():
        logp = model(input_ids=ids, position_ids=positions).logits[0].double().log_softmax(-1)
    return logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]


def test_a_reload_warns_for_the_rotary_cache_alone_and_keeps_it(
    vllm_server: str, vllm_server_log: Path, tmp_path: Path
) -> None:
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    ours = write_weights(model, tmp_path / "engine-weights")
    assert _reload_warnings(vllm_server, vllm_server_log, ours) == (["RotaryEmbedding"], False)
    own, _ = _reload_warnings(vllm_server, vllm_server_log, WIDE_DEMO_MODEL)  # save_pretrained's files
    assert "RotaryEmbedding" in own  # the model's own checkpoint trips it too: not treetrain's file

    tokens = [(37 * i + 11) % model.config.vocab_size for i in range(300)]
    served, own = _served(vllm_server, tokens), _own(model, tokens)
    assert float((served - own).abs().max()) < GAP
    assert float((served - _own(model, tokens, stride=2)).abs().max()) > OTHER_TABLE  # another rotary table

    holed = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    attention = holed.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, torch.nn.Identity())  # gone from the state dict, so from the file
    missing = write_weights(holed, tmp_path / "missing")
    try:
        warned, lacking = _reload_warnings(vllm_server, vllm_server_log, missing)
    finally:  # the server back on the demo's weights, confirmed by the engine's own probe
        engine = VLLMServerEngine(
            VLLMSettings(urls=(vllm_server,)), weights_dir=tmp_path / "restore",
            expected=Expected(path=str(WIDE_DEMO_MODEL), dtype="float32", max_model_len=1024),
        )  # fmt: skip
        engine.sync_weights(model, 0)
        engine.close()
    assert sorted(warned) == ["QKVParallelLinear", "RotaryEmbedding"] and lacking  # negative control
