"""A mixture of experts through a real vLLM (the CPU build `make test` installs): a tiny `qwen3_moe` trains
two updates with `rollout.engine=vllm` with the sampler/trainer gap at rounding, and for it and a tiny
`mixtral` the engine's logprobs are the trainer's after a sync of moved weights. Negative controls: two experts swapped in the export, and
the reload without vLLM's CPU experts packed again, each leave a gap of nats."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.moe_cases import save_tiny_moe
from transformers import AutoModelForCausalLM

from treetrain.rollout import Sampling
from treetrain.rollout.engines.cpu_expert_repack import repack_cpu_experts
from treetrain.rollout.engines.generation import GenerationRequest, GenerationResult
from treetrain.rollout.engines.weight_buckets import weight_buckets
from treetrain.train.metrics import read_metrics

GAP = 1e-4
"""Largest |logp_trainer - logp_vllm| on a sampled token with the same float32 weights; measured 1.9e-6."""
WRONG = 0.1
"""A gap that no rounding gives: a wrong expert or a misread kernel layout moves logprobs by nats."""
CONTEXT = tuple(range(5, 40))


def _served(tmp_path_factory: pytest.TempPathFactory, family: str) -> Iterator[tuple[Path, Any]]:
    from treetrain.rollout.engines.engine_settings import VLLMSettings
    from treetrain.rollout.engines.vllm_engine import VLLMEngine

    directory = save_tiny_moe(tmp_path_factory.mktemp(family), family)
    engine = VLLMEngine(str(directory), VLLMSettings(), dtype="float32", max_model_len=512, seed=0)
    yield directory, engine
    engine.close()


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any]]:
    """The tiny qwen3_moe's checkpoint directory and one vLLM engine serving it, for this module."""
    yield from _served(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any]]:
    """The same for a tiny mixtral (its checkpoint names: `block_sparse_moe.experts.{i}.w1`, `w2`, `w3`)."""
    yield from _served(tmp_path_factory, "mixtral")


def _gap(engine: Any, model: Any) -> float:
    """Largest |HF - vLLM| logprob over two sampled continuations of `CONTEXT`."""
    engine.submit(GenerationRequest(CONTEXT, 2, 24, Sampling(temperature=1.0), ((2,),)))
    results: list[GenerationResult] = []
    while engine.busy:
        results += engine.poll()
    gaps = []
    for c in results[0].completions:
        with torch.no_grad():
            logp = model(torch.tensor([CONTEXT + c.tokens])).logits.log_softmax(-1)[0]
        hf = [logp[len(CONTEXT) + i - 1, t].item() for i, t in enumerate(c.tokens)]
        gaps.append(max(abs(a - b) for a, b in zip(hf, c.logprobs)))
    return max(gaps)


def _reload(engine: Any, weights: Iterable[tuple[str, torch.Tensor]], repack: bool = True) -> None:
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    if repack:
        engine.llm.collective_rpc(repack_cpu_experts)
    engine.llm.reset_prefix_cache()


def _swapped(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The export with experts 0 and 1 of layer 0 exchanged."""
    swap = {"experts.0.": "experts.1.", "experts.1.": "experts.0."}
    for bucket in weight_buckets(model):
        for name, tensor in bucket:
            if name.startswith("model.layers.0.") and ".experts." in name:
                for a, b in swap.items():
                    if f".{a}" in name:
                        name = name.replace(f".{a}", f".{b}")
                        break
            yield name, tensor


@pytest.mark.parametrize("family", ["moe", "mixtral"])
def test_vllm_samples_from_the_synced_experts(family: str, request: pytest.FixtureRequest) -> None:
    directory, engine = request.getfixturevalue(family)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert _gap(engine, model) < GAP  # as loaded from the checkpoint
    torch.manual_seed(3)
    for p in model.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)  # weights vLLM has never seen
    engine.sync_weights(model, engine.version + 1)
    assert _gap(engine, model) < GAP
    _reload(engine, _swapped(model))
    assert _gap(engine, model) > WRONG  # negative control: the export's expert order matters
    _reload(engine, (p for b in weight_buckets(model) for p in b), repack=False)
    assert _gap(engine, model) > WRONG  # negative control: vLLM's CPU reload needs the experts packed
    engine.sync_weights(model, engine.version + 1)
    assert _gap(engine, model) < GAP


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_mixture_of_experts_trains_with_vllm_rollouts(moe: tuple[Path, Any], tmp_path: Path) -> None:
    directory, _ = moe
    run = tmp_path / "run"
    settings = [
        f"model.path={directory}", "rollout.engine=vllm", "env.name=support.scripted_envs:DigitsToolEnv",
        "updates=2", "checkpoint_every=0", "threads=1", "rollout.groups_per_update=2", "rollout.fanout.root=4",
        "measure_memory_every=0",
    ]  # fmt: skip
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    args = [sys.executable, "-m", "treetrain", "train", "--run-dir", str(run), "--no-progress"]
    done = subprocess.run([*args, *(a for kv in settings for a in ("--set", kv))], env=env,
                          capture_output=True, text=True, timeout=840)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m.version for m in metrics] == [1, 2]
    assert all(m.groups_dropped < m.groups for m in metrics)  # both updates stepped
    for m in metrics:  # sampled with the weights the update trained on, synced after every step
        assert m.sampler_logprob_gap_max is not None and m.sampler_logprob_gap_max < GAP, m


def _samples(engine: Any) -> list[GenerationResult]:
    engine.submit(GenerationRequest(CONTEXT, 1, 8, Sampling(temperature=1.0), ((2,),)))
    results: list[GenerationResult] = []
    while engine.busy:
        results += engine.poll()
    return results


def test_an_moe_engine_starts_and_closes_beside_a_dense_one(
    vllm_engine: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM keeps its parallel groups per process: an MoE engine started beside the session's dense engine
    (whose groups have no expert-parallel one) gets its own, and its close, which destroys the process's
    groups, leaves the dense engine sampling."""
    served = _served(tmp_path_factory, "qwen3_moe")
    directory, engine = next(served)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert _gap(engine, model) < GAP
    next(served, None)  # closes it
    assert len(_samples(vllm_engine)[0].completions[0].tokens) > 0
