"""A real vLLM (the CPU build `make test` installs) as the rollout engine: token round trip, logprob
agreement with the trainer's model, weight sync after an optimizer step, and the prefix cache on a tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from support.interrupted import go_on, version_gaps
from transformers import AutoTokenizer, LlamaForCausalLM

from envs import EpisodeLimits, WrapperConfig, make_env
from treetrain.rollout import FanOut, RolloutConfig, SamplerConfig, Sampling, rollout_trees
from treetrain.rollout.engines.generation import Draft, GenerationRequest, GenerationResult
from treetrain.rollout.engines.recording_engine import RecordingEngine
from treetrain.train.models import WIDE_DEMO_MODEL
from treetrain.trajectory import Role

torch.set_num_threads(1)
WRAPPER = WrapperConfig(
    EpisodeLimits(max_turns=3, max_turn_tokens=48, max_episode_tokens=1024), stop_token_ids=(2,)
)
LOGPROB_TOLERANCE = 1e-4
"""|vLLM - HF| logprob in float32 on the same weights; measured at 3.4e-7 here."""


def _policy(model: Any, tree: Any) -> list[tuple[tuple[int, ...], tuple[float, ...], float]]:
    """(tokens, recorded logprobs, max |HF logprob - recorded|) of every policy segment of every call."""
    out = []
    for trajectory in tree.trajectories():
        for call in trajectory.calls:
            tokens = [t for seg in call.segments for t in seg.tokens]
            with torch.no_grad():
                logp = model(torch.tensor([tokens])).logits.log_softmax(-1)[0]  # [T, V]
            pos = 0
            for seg in call.segments:
                if seg.role is Role.POLICY:
                    hf = [logp[pos + i - 1, t].item() for i, t in enumerate(seg.tokens)]
                    gap = max(abs(a - b) for a, b in zip(hf, seg.logprobs))
                    out.append((seg.tokens, seg.logprobs, gap))
                pos += len(seg.tokens)
    return out


def test_trees_hold_exactly_what_vllm_sampled_with_the_trainers_logprobs(
    vllm_engine: Any, tmp_path: Path
) -> None:
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    tok = AutoTokenizer.from_pretrained(WIDE_DEMO_MODEL)
    engine = RecordingEngine(vllm_engine)
    config = RolloutConfig(FanOut(root=4), SamplerConfig(Sampling(temperature=1.0), seed=1), WRAPPER,
                           model_version=vllm_engine.version)  # fmt: skip
    result = rollout_trees(model, tok, lambda: make_env("calculator"), [0, 1], tmp_path, config,
                           env_name="calculator", engine=engine)  # fmt: skip
    sampled = {c.tokens: c.logprobs for r in engine.answers for c in r.completions}
    segments = [s for tree in result.trees for s in _policy(model, tree)]
    assert len(segments) >= 8
    for tokens, logprobs, gap in segments:  # a turn cut by the budget gets its end marker as observation
        assert sampled[tokens] == logprobs
        assert gap < LOGPROB_TOLERANCE
    forks = [r for r in engine.answers if engine.asked[r.request_id].n == 1]  # turns after a tool result
    assert forks, "the calculator answered no tool call"
    for answer in forks:  # the cache holds the whole path up to the last full block (32 tokens on CPU)
        context = len(engine.asked[answer.request_id].context)
        assert answer.cached_tokens >= context - 2 * 32


def test_weight_sync_after_an_optimizer_step(vllm_engine: Any) -> None:
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    context = tuple(
        AutoTokenizer.from_pretrained(WIDE_DEMO_MODEL).encode(
            "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n"
        )
    )

    def greedy(version: int) -> tuple[int, ...]:
        vllm_engine.submit(GenerationRequest(context, 1, 16, Sampling(temperature=0.0), ((2,),)))
        results: list[GenerationResult] = []
        while vllm_engine.busy:
            results += vllm_engine.poll()
        assert results[0].completions[0].version == version
        return results[0].completions[0].tokens

    def hf_greedy() -> tuple[int, ...]:
        with torch.no_grad():
            out = model.generate(torch.tensor([context]), max_new_tokens=16, do_sample=False, eos_token_id=2)
        return tuple(out[0, len(context) :].tolist())

    version = vllm_engine.version
    before = greedy(version)
    assert before == hf_greedy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    logits = model(torch.tensor([context + before])).logits  # [1, T, V]
    logits[0, len(context) - 1 :].log_softmax(-1).gather(-1, torch.tensor(before)[:, None]).sum().backward()
    optimizer.step()  # a step against the greedy answer: it must change
    model.eval()
    vllm_engine.sync_weights(model, version + 1)
    after = greedy(version + 1)
    assert after != before and after == hf_greedy()
    model.load_state_dict(original)
    vllm_engine.sync_weights(model, version + 2)  # the session's engine serves the shipped weights again
    assert greedy(version + 2) == before


def test_without_vllm_the_engine_says_how_to_install_it(monkeypatch: Any) -> None:
    import sys

    import pytest

    from treetrain.rollout.engines.generation import EngineError
    from treetrain.rollout.engines.vllm_engine import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if it were not installed
    with pytest.raises(EngineError, match=r"^rollout.engine=vllm: vLLM is not installed .*pip install"):
        import_vllm("rollout.engine=vllm")


def test_a_sample_interrupted_for_new_weights_goes_on_under_them(vllm_engine: Any) -> None:
    """Abort and resubmit with the tokens so far: what vLLM drew before the interrupt is the old weights'
    (scored by the trainer's old model), the rest the new weights', and the stitched sample says which."""
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    newer = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.02 * torch.randn_like(p))
    context = tuple(AutoTokenizer.from_pretrained(WIDE_DEMO_MODEL).encode("<|im_start|>user\nHi<|im_end|>\n"))
    version, stop = vllm_engine.version, ((511, 512, 513),)  # vLLM stops on none: samples run to 12
    rid = vllm_engine.submit(GenerationRequest(context, 2, 12, Sampling(), stop, seed=5))
    for _ in range(4):
        assert vllm_engine.poll() == []
    (stopped,) = vllm_engine.interrupt()
    assert stopped.request_id == rid and not vllm_engine.busy
    drafts = stopped.samples
    assert all(isinstance(d, Draft) and 1 <= len(d.tokens) < 12 for d in drafts), drafts
    vllm_engine.sync_weights(newer, version + 1)
    try:
        whole = go_on(vllm_engine, context, [d for d in drafts if isinstance(d, Draft)], 12, stop)
    finally:
        vllm_engine.sync_weights(model, version + 2)  # the session's engine serves the shipped weights again
    for sample in whole:
        assert len(sample.tokens) == 12 and sample.version == version + 1
        (n_old, v_old), (n_new, v_new) = sample.version_runs
        assert (v_old, v_new) == (version, version + 1) and n_old + n_new == 12
        own, other = version_gaps(context, sample, model, newer)
        assert own < LOGPROB_TOLERANCE and other > 1e-3  # other: the versions swapped (negative control)
