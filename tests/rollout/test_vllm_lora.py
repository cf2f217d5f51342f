"""LoRA through a real vLLM (the CPU build `make test` installs): the engine keeps the base weights it
loaded and receives only the adapter at each sync, and after several optimizer steps its logprobs are the
trainer's at rounding. Negative control: a step whose adapter is not synced leaves a gap. A LoRA vLLM cannot
serve as an adapter (`modules_to_save`) goes merged into the session's plain engine, also at rounding."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from treetrain.models.lora import apply_lora
from treetrain.models.lora_config import LoraSection
from treetrain.rollout import Sampling
from treetrain.rollout.engines.adapter_sync import lora_serving
from treetrain.rollout.engines.generation import GenerationRequest, GenerationResult
from treetrain.train.models import WIDE_DEMO_MODEL

GAP = 1e-4
"""Largest |logp_trainer - logp_vllm| on a sampled token, adapter applied by vLLM's LoRA kernels in float32."""
WRONG = 1e-2
"""A gap no rounding gives: the engine samples from another adapter than the trainer's."""
CONTEXT = tuple(range(5, 40))
LORA = LoraSection(r=4, alpha=8)


def _policy(section: LoraSection = LORA) -> Any:
    torch.manual_seed(0)
    return apply_lora(LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL, dtype=torch.float32), section)


@pytest.fixture(scope="module")
def lora_engine() -> Iterator[Any]:
    """One vLLM engine started for adapters (`enable_lora`) on the wide demo model, for this module."""
    from treetrain.rollout.engines.engine_settings import VLLMSettings
    from treetrain.rollout.engines.vllm_engine import VLLMEngine

    serving = lora_serving(_policy())
    assert serving is not None and serving.as_adapter
    engine = VLLMEngine(str(WIDE_DEMO_MODEL), VLLMSettings(), dtype="float32", max_model_len=512, seed=0,
                        lora=serving)  # fmt: skip
    yield engine
    engine.close()


def _gap(engine: Any, model: Any) -> float:
    """Largest |trainer - vLLM| logprob over two sampled continuations of `CONTEXT`."""
    engine.submit(GenerationRequest(CONTEXT, 2, 24, Sampling(temperature=1.0), ((2,),)))
    results: list[GenerationResult] = []
    while engine.busy:
        results += engine.poll()
    gaps = []
    for c in results[0].completions:
        assert c.version == engine.version
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([CONTEXT + c.tokens])).logits.log_softmax(-1)[0]
        hf = [logp[len(CONTEXT) + i - 1, t].item() for i, t in enumerate(c.tokens)]
        gaps.append(max(abs(a - b) for a, b in zip(hf, c.logprobs)))
    return max(gaps)


def _step(model: Any, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer step against the logprob of a fixed continuation: it moves every adapter."""
    ids = torch.tensor([CONTEXT + tuple(range(60, 76))])
    model(input_ids=ids).logits[0, len(CONTEXT) - 1 : -1].log_softmax(-1).gather(
        -1, ids[0, len(CONTEXT) :, None]
    ).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_vllm_samples_from_the_synced_adapter_after_several_steps(lora_engine: Any) -> None:
    model = _policy()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    full = sum(p.numel() * p.element_size() for p in model.get_base_model().parameters())
    for step in range(3):
        _step(model, optimizer)
        before = lora_engine.stats.sync_bytes
        lora_engine.sync_weights(model, step + 1)
        assert lora_engine.stats.sync_bytes - before < full / 10  # the adapter, not the model
        assert _gap(lora_engine, model) < GAP, step
    _step(model, optimizer)  # negative control: a step the engine does not receive
    assert _gap(lora_engine, model) > WRONG


def test_a_lora_vllm_cannot_serve_as_an_adapter_goes_merged(vllm_engine: Any) -> None:
    section = LoraSection(r=4, alpha=8, modules_to_save=("norm",))
    model = _policy(section)
    serving = lora_serving(model)
    assert serving is not None and not serving.as_adapter and "modules_to_save" in serving.line()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    _step(model, optimizer)
    version = vllm_engine.version
    try:
        vllm_engine.sync_weights(model, version + 1)
        assert _gap(vllm_engine, model) < GAP
    finally:
        vllm_engine.sync_weights(LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL), version + 2)
