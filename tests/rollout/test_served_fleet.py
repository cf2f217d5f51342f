"""Two real `vllm serve` processes (the docs' command), one killed with SIGKILL mid-rollout: the rollout
finishes on the other, every sample whole, its tokens the ones drawn on the killed server followed by the
rest, and every logprob the trainer's own for its token (so the parts join where they should); the loss is
counted and named. The servers' metrics, read from the real endpoint, name what the router reads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import GenerationRequest, GenerationResult
from treetrain.rollout.engines.server_calls import fetch_text
from treetrain.rollout.engines.server_checks import Expected
from treetrain.rollout.engines.server_fleet import read_load
from treetrain.rollout.engines.server_parts import Ledger, Part
from treetrain.rollout.engines.vllm_server import VLLMServerEngine
from treetrain.rollout.sampling import Sampling
from treetrain.train.models import WIDE_DEMO_MODEL

pytestmark = pytest.mark.slow
GAP = 1e-4
"""|vLLM - trainer| logprob of a sampled token on the same float32 weights (test_served_engine.py)."""
BUDGET = 600
"""Tokens a sample may draw: long enough that the server is still sampling when the kill lands (the demo
model ends its answers with <|im_end|> after a few tokens, so the samples stop only at <|im_start|>, which
it rarely draws)."""
STOP = 1
GROUPS = 6


def _trainer_gap(
    model: Any, context: tuple[int, ...], tokens: tuple[int, ...], logprobs: tuple[float, ...]
) -> float:
    with torch.no_grad():
        logp = model(torch.tensor([context + tokens])).logits[0, len(context) - 1 : -1].log_softmax(-1)
    own = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return float((own - torch.tensor(logprobs)).abs().max())


def test_a_server_killed_mid_rollout_is_routed_around(
    vllm_server: str, second_vllm_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    doomed = second_vllm_server.base
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    want = Expected(path=str(WIDE_DEMO_MODEL), dtype="float32", max_model_len=1024)
    engine = VLLMServerEngine(
        VLLMSettings(urls=(doomed, vllm_server)), weights_dir=tmp_path / "w", expected=want
    )  # the first new tree goes to the first of idle servers: the one killed
    resumed: list[Part] = []  # the parts a lost server's samples go on as
    lost = Ledger.lost

    def spy(self: Ledger, pid: int) -> list[Part]:
        rest = lost(self, pid)
        resumed.extend(rest)
        return rest

    monkeypatch.setattr(Ledger, "lost", spy)
    tok = AutoTokenizer.from_pretrained(WIDE_DEMO_MODEL)
    try:
        engine.sync_weights(model, 0)
        contexts = {}
        for g in range(GROUPS):
            prompt = f"<|im_start|>user\nWhat is {17 + g} * {23 + g}?<|im_end|>\n<|im_start|>assistant\n"
            request = GenerationRequest(
                tuple(tok.encode(prompt)), 2, BUDGET, Sampling(), ((STOP,),), seed=g, group=f"t{g}"
            )
            contexts[engine.submit(request)] = request.context
        killed = threading.Event()
        results: list[GenerationResult] = []
        with caplog.at_level("WARNING"):
            while engine.busy:
                results += engine.poll()
                with engine._lock:  # a sample on the doomed server has drawn tokens and goes on: kill it now
                    drawing = any(
                        p.server == 0 and 2 <= max(map(len, p.streamed.tokens)) < BUDGET // 4
                        for p in engine._ledger.parts.values()
                    )
                if drawing and not killed.is_set():
                    second_vllm_server.kill()
                    killed.set()
    finally:
        engine.close()
    assert killed.is_set(), "the rollout ended before a sample on the second server had drawn tokens"
    assert len(results) == GROUPS and all(len(r.completions) == 2 for r in results)
    for r in results:
        for c in r.completions:
            assert 1 <= len(c.tokens) <= BUDGET and (c.finish == "stop") == (c.tokens[-1] == STOP)
            assert c.version == 0 and _trainer_gap(model, contexts[r.request_id], c.tokens, c.logprobs) < GAP
    went_on = [p for p in resumed if p.draft.tokens]
    assert went_on, "no sample of the killed server went on from the tokens it drew"
    by_rid = {r.request_id: r for r in results}
    for part in went_on:  # each went on from exactly what it drew, its logprobs kept
        for slot in part.slots:
            whole = by_rid[part.rid].completions[slot]
            n = len(part.draft.tokens)
            assert whole.tokens[:n] == part.draft.tokens and whole.logprobs[:n] == part.draft.logprobs
            assert part.request.context == contexts[part.rid] + part.draft.tokens
    assert engine.stats.servers_lost == 1 and engine.fleet.alive == (1,)
    (line,) = [r.getMessage() for r in caplog.records if " is lost (" in r.getMessage()]
    assert line.startswith(f"vllm-server {doomed} is lost (") and "1 of 2 servers left" in line, line
    (gone, kept) = engine.stats.servers
    assert gone.requests >= 1 and kept.requests > len(resumed)
    assert kept.queued >= kept.requests and kept.queue_seconds >= 0  # read from its histogram once idle
    text = fetch_text(vllm_server, "/metrics", 10.0, 2**22)
    assert text is not None and read_load(text).queued >= kept.requests  # the names the router reads exist
