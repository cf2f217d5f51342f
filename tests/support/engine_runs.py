"""Running requests on an engine to the end, for the tests that compare engines sample by sample."""

from __future__ import annotations

from typing import Any

from treetrain.rollout.engines.generation import GenerationRequest, GenerationResult


def run_requests(engine: Any, requests: list[GenerationRequest]) -> dict[int, GenerationResult]:
    """Submit every request, poll until the engine is idle; the results by request order."""
    ids = [engine.submit(r) for r in requests]
    done: dict[int, GenerationResult] = {}
    while engine.busy:
        done.update((r.request_id, r) for r in engine.poll())
    return {i: done[rid] for i, rid in enumerate(ids)}
