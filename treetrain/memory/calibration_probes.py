"""The memory calibration's probes: small trees replayed on the real model, and what each step measured.

`treetrain.memory.calibrate` fits byte costs to shapes; this module supplies the measurements it fits. A
probe is a tree of a given shape (prompt, shared policy tokens, fan-out per level, turn length) replayed with
a given microbatch and chunk under a `MemoryTracker`; `measure` runs every probe and pairs each scoring
batch and replay step with its shape (`treetrain.memory.events`). Which probes run is part of the
calibration's cache key, so the set lives here, beside the code that runs it.

Example:
    >>> tree = probe_tree(8, 2, (2, 2), 4, vocab=64, seed=0)
    >>> len(tree.trajectories())
    4
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.events import Shape, plan_tree
from treetrain.memory.persistent import kv_bytes_per_token, state_bytes_per_unit
from treetrain.memory.tracker import MeasuredSegment, MemoryTracker
from treetrain.models.support import SupportGate
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.schedule import Contract
from treetrain.replay.tree_replay import TreeReplay
from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree.build import build_tree
from treetrain.tree.trajectory_tree import TrajectoryTree


@dataclass(frozen=True)
class Probe:
    """One probe tree: a `prompt` (and `shared` policy tokens), then `fans[i]` branches per level of
    `turn` tokens each, replayed with K = `microbatch` (0: all siblings) and units of `chunk` tokens."""

    prompt: int
    shared: int
    fans: tuple[int, ...]
    turn: int
    microbatch: int
    chunk: int | None = None


#: Short probes: many shapes (K, depth, shared tokens), each cheap.
PROBES: tuple[Probe, ...] = (
    Probe(10, 0, (2,), 6, 0),
    Probe(24, 3, (3,), 9, 0),
    Probe(20, 4, (1,), 14, 0),
    Probe(64, 0, (3,), 20, 0),
    Probe(40, 0, (4,), 4, 2),
    Probe(12, 0, (3, 2), 10, 0),
    Probe(40, 0, (4, 2), 6, 0),
    Probe(26, 0, (4, 2), 12, 3),
    Probe(48, 2, (2, 2), 4, 0),
    Probe(5, 2, (2, 2, 2), 5, 3),
    Probe(160, 0, (2,), 4, 0),
    Probe(100, 3, (2,), 5, 1),
)

LONG_PROBE = 1024
"""Tokens of the longest probe sequence (capped by the model's position limit)."""


def long_probes(length: int) -> tuple[Probe, ...]:
    """Probes at `length` and `length // 2` tokens, so per-token costs are measured, not extrapolated.

    Short probes alone cannot tell a per-token cost from a per-token-squared one or from a constant (the
    largest weight's gradient, alive for an instant in backward, is as large as a 100-token graph), and
    flat's whole sequences are many times longer. Two whole sequences without a past pin the no-past
    regime's slope; a chunked prompt with two short branches gives the past regime long pasts and wide
    chunks. Each is one forward and backward of at most `length` tokens.

    Example:
        >>> [p.prompt + p.turn for p in long_probes(1024)]
        [1024, 512, 256, 1024]
    """
    half, quarter = length // 2, length // 4
    return (
        Probe(length - 64, 0, (1,), 64, 0),
        Probe(half - 16, 0, (1,), 16, 0),
        Probe(quarter - 48, 0, (1,), 48, 0),
        Probe(length - 16, 0, (2,), 16, 2, chunk=quarter),
    )


def probes_for(model: PreTrainedModel) -> tuple[Probe, ...]:
    """The short probes and the long ones that fit `model`'s position limit."""
    config = model.config.get_text_config(decoder=True)
    limit = int(getattr(config, "max_position_embeddings", None) or LONG_PROBE)
    length = min(LONG_PROBE, limit)
    return PROBES + (long_probes(length) if length >= 256 else ())


def probe_tree(
    prompt: int, shared: int, fans: tuple[int, ...], turn: int, vocab: int, seed: int
) -> TrajectoryTree:
    """Trajectories sharing a prompt (and `shared` policy tokens), then branching `fans[i]` ways per level."""
    rng = random.Random(seed)
    high = max(2, min(vocab, 1000))

    def seg(role: Role, n: int) -> Segment:
        toks = tuple(rng.randrange(1, high) for _ in range(n))
        return Segment(role, toks, tuple(-1.0 for _ in toks) if role is Role.POLICY else None)

    head = [seg(Role.PROMPT, prompt)] + ([seg(Role.POLICY, shared)] if shared else [])
    paths = [head]
    for level, fan in enumerate(fans):
        grown = []
        for p in paths:
            for _ in range(fan):
                more = [seg(Role.POLICY, turn)]
                if level < len(fans) - 1:
                    more.append(seg(Role.OBSERVATION, max(1, turn // 3)))
                grown.append(p + more)
        paths = grown
    trajs = [Trajectory(f"probe{seed}-{i}", (Call(tuple(p)),), float(i % 2)) for i, p in enumerate(paths)]
    return build_tree(trajs)


@dataclass(frozen=True)
class StepSample:
    shape: Shape
    forward: int
    graph: int
    backward: int


def _segments(tracker: MemoryTracker) -> dict[str, MeasuredSegment]:
    return {s.label: s for s in tracker.segments}


def measure(
    model: PreTrainedModel,
    contract: Contract,
    *,
    with_entropy: bool,
    max_logit_elements: int,
    probes: tuple[Probe, ...] | None = None,
) -> tuple[list[StepSample], list[tuple[Shape, int]]]:
    """Run the probes (default `probes_for(model)`); return measured steps and no-grad batches.

    Parameter `.grad`s are restored. Memory does not depend on parameter values, so the probes run on
    the model as it is."""
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    per_token = kv_bytes_per_token(model)
    logit_rows, head_grad = max(1, max_logit_elements // vocab), head_grad_bytes(model)
    loss = LossConfig(entropy_coef=0.01 if with_entropy else 0.0)
    saved = [p.grad for p in model.parameters()]
    steps: list[StepSample] = []
    nograd: list[tuple[Shape, int]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # probes are tiny: more threads cost more than they give
    try:
        name = str(getattr(model.config, "model_type", "model"))
        chosen = probes_for(model) if probes is None else probes
        hidden = os.environ.get("TQDM_DISABLE", "") not in ("", "0")  # `--no-progress`: no bars at all
        shown = tqdm(
            chosen,
            desc=f"calibrating {name} memory ({contract})",
            leave=False,
            disable=True if hidden else None,
        )
        for seed, probe in enumerate(shown):
            for p in model.parameters():  # the ledger books gradients from the window's start
                # (not a ZeRO-3 parameter: it is partitioned here, its gradient has the full shape)
                partitioned = getattr(p, "ds_numel", p.numel()) != p.numel()
                p.grad = torch.zeros_like(p) if p.requires_grad and not partitioned else None
            tree = probe_tree(probe.prompt, probe.shared, probe.fans, probe.turn, vocab, seed)
            adv = compute_advantages([tree], AdvantageConfig(zero_variance="keep"))
            batch = UpdateBatch.build([tree], adv.trees, loss)
            cfg = ReplayConfig(
                contract=contract,
                microbatch=probe.microbatch,
                chunk_size=probe.chunk,
                skip_inert=False,
                max_logit_elements=max_logit_elements,
            )
            tracker = MemoryTracker(next(model.parameters()).device)
            engine = TreeReplay(
                model, loss, cfg, support=SupportGate(trusting=True), hooks=ReplayHooks(tracker=tracker)
            )
            engine.accumulate(batch)
            tracker.detach()
            segs = _segments(tracker)
            plan = plan_tree(
                batch.work[0],
                cfg,
                loss,
                kv_bytes_per_token=per_token,
                state_bytes_per_unit=state_bytes_per_unit(model),
            )
            for ev in plan.events:
                seg = segs.get(ev.label)
                if seg is None:
                    continue
                if ev.kind == "score":
                    nograd.append((ev.shape, seg.peak.total - seg.start.total))
                elif ev.kind == "step" and ev.shape.rows:
                    back = segs[f"{ev.label} backward"]
                    # new G accumulators are allocated before the forward and booked by the ledger
                    # as resident bytes, exactly, so the fits see only the step's own bytes
                    start = seg.start.total + ev.shape.new_grad_tokens * per_token
                    multi = head_grad if ev.shape.targets > logit_rows else 0  # known exactly too
                    steps.append(
                        StepSample(
                            ev.shape,
                            seg.peak.total - start,
                            back.start.total - start,
                            back.peak.total - start - multi,
                        )
                    )
    finally:
        torch.set_num_threads(threads)
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    return steps, nograd


def head_grad_bytes(model: PreTrainedModel) -> int:
    """Bytes of the output head weight's gradient (0 when it is frozen, e.g. under LoRA)."""
    head = model.get_output_embeddings()
    w = getattr(head, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.requires_grad:
        return 0
    return int(getattr(w, "ds_numel", w.numel())) * w.element_size()
