"""An engine wrapper that keeps every request and answer: for checking what a rollout asked an engine, and
for measuring it (`bench/rollout_engines.py` computes the prefix-cache ceiling from it).

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from treetrain.rollout.engines.generation import GenerationRequest
    >>> from treetrain.rollout.engines.hf_engine import HFEngine
    >>> from treetrain.rollout.sampling import Sampling
    >>> _ = torch.manual_seed(0)
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
    >>> engine = RecordingEngine(HFEngine(model))
    >>> rid = engine.submit(GenerationRequest((5, 6), 2, 3, Sampling(), ((1,),)))
    >>> while engine.busy:
    ...     _ = engine.poll()
    >>> engine.asked[rid].n, [len(r.completions) for r in engine.answers]
    (2, [2])
"""

from __future__ import annotations

from typing import Any

from treetrain.rollout.engines.generation import GenerationRequest, GenerationResult


class RecordingEngine:
    """Passes everything through to `engine`; keeps each request by id (`asked`) and each answer."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.asked: dict[int, GenerationRequest] = {}
        self.answers: list[GenerationResult] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @property
    def busy(self) -> bool:
        return bool(self.engine.busy)

    def submit(self, request: GenerationRequest) -> int:
        rid = int(self.engine.submit(request))
        self.asked[rid] = request
        return rid

    def poll(self) -> list[GenerationResult]:
        out = list(self.engine.poll())
        self.answers += out
        return out
