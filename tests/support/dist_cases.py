"""Shared by the distributed worker (tests/distributed/worker.py) and its single-process references.

One update of two groups (a multi-level tree and a one-level tree, normalized together by the manifest),
a tiny float32 llama, plain SGD. `reference_delta` is the parameter change of one step in one process with
plain torch: the oracle that every distributed scenario is compared with.

The comparisons use SGD without clipping or weight decay, where the delta is exactly `-lr * g`: a gradient
off by any factor (a missing rescale over ranks, a division by an accumulation count) moves it by that
factor. AdamW's first step is about `lr * sign(g)` and would hide such an error; `ADAMW` cases check that
the AdamW path (and its optimizer state across a resume) works too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel

from support.lora_cases import lora_factory
from support.replay_cases import SHAPES, VOCAB, factory
from treetrain.distributed import OptimizerConfig, TorchBackend
from treetrain.loss.advantages import AdvantageConfig
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.calibrate import calibrate
from treetrain.memory.overrides import Mode
from treetrain.models.lora import AdaptersOff
from treetrain.replay import FlatReference, ReplayConfig, TreeReplay, UpdateBatch
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.schedule import CONTRACTS, Contract
from treetrain.replay.verify import _perturb
from treetrain.update.learner import Learner
from treetrain.update.run import UpdateOutcome, run_update
from treetrain.update.settings import ReplaySection, UpdateConfig
from treetrain.update.window_types import Group, WindowReport

LOSS = LossConfig()
OPTIMIZER = OptimizerConfig(name="sgd", lr=1.0, weight_decay=0.0, grad_clip=0.0)
"""Scale-sensitive: delta = -lr * g (|g| is about 0.7 here, so |delta| is far above float32 rounding)."""
ADAMW = OptimizerConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
make_model = factory("llama", torch.float32)
RECURRENT_DIST = ("qwen3_5_text", "nemotron_h")
"""Hybrid families in the same checks: Gated DeltaNet (Qwen3.5) and Mamba-2 (Nemotron-H) layers around
attention, whose resident objects are (conv state, recurrent state) as well as KV."""
make_lora_model = lora_factory("llama", torch.float32)
"""The same llama with LoRA adapters (B set as if trained, so adapters off differs from on)."""
LORA_LOSS = LossConfig(kl_coef=0.2)
"""With KL: the reference is the policy with its adapters off."""
STAGES = {"z0": (0, False), "z1": (1, False), "z2": (2, False), "z3": (3, False), "z2off": (2, True)}
"""Name -> (ZeRO stage, optimizer CPU offload)."""


def model_factory(family: str = "llama") -> Callable[[], PreTrainedModel]:
    """The float32 tiny model of `family` that a scenario and its reference both build (llama by default)."""
    return make_model if family == "llama" else factory(family, torch.float32)


def calibrate_first(makes: Iterable[Callable[[], PreTrainedModel]]) -> None:
    """Calibrate each model factory's model here, in one process, into the run's calibration store
    (`tests/conftest.py`) before a launch reads it: otherwise every rank of the launch measures the same
    model (four ranks on two cores), and a ZeRO-3 rank fetches each probe's parameters from the others.
    Both contracts, whatever a scenario replays: the planner prices the flat update against the tree's
    (`treetrain.train.prewarm` does the same for a `treetrain train` launch). A repeated model is a hit of
    the in-process cache."""
    for make in makes:
        model = make()
        for contract in CONTRACTS:
            calibrate(model, contract, with_entropy=LOSS.needs_entropy)


def groups(seed: int = 0) -> list[Group]:
    trees = SHAPES["two_trees"](seed)
    adv = AdvantageConfig(zero_variance="keep")
    return [Group.build([t], adv) for t in trees]


def params_vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64).cpu() for p in model.parameters()])


def reference_delta(
    contract: str,
    update: Sequence[Group],
    *,
    replay: ReplayConfig | None = None,
    flat_microbatch: int = 1,
    perturb: bool = False,
    optimizer: OptimizerConfig = OPTIMIZER,
    lora: bool = False,
    family: str = "llama",
) -> torch.Tensor:
    """One optimizer step in one process with plain torch and the engine directly (no update window):
    contract 'flat' (the conventional run) or a tree contract. `lora`: the LoRA model with KL against
    its adapters-off self; `family`: another tiny model than the llama (`RECURRENT_DIST`)."""
    make = make_lora_model if lora else model_factory(family)
    loss = LORA_LOSS if lora else LOSS
    model: PreTrainedModel = make()
    ref = AdaptersOff(model) if lora else None
    if perturb:
        _perturb(model, seed=99)
    start = params_vector(model)
    backend = TorchBackend(model, optimizer)
    trees = [t for g in update for t in g.trees]
    batch = UpdateBatch.build(trees, [a for g in update for a in g.advantages], loss)
    if contract == "flat":
        flat = ReplayConfig(microbatch=flat_microbatch)
        FlatReference(model, loss, flat, ref_model=ref, backward=backend.backward).accumulate(batch)
    else:
        cfg = replay or ReplayConfig(contract=contract)  # type: ignore[arg-type]
        TreeReplay(model, loss, cfg, ref_model=ref, hooks=ReplayHooks(backward=backend.backward)).accumulate(
            batch
        )
    backend.step()
    delta = params_vector(model) - start
    if perturb:
        delta = delta + (start - params_vector(make()))
    return delta


def delta_floor(
    contract: str,
    update: Sequence[Group],
    optimizer: OptimizerConfig = OPTIMIZER,
    lora: bool = False,
    family: str = "llama",
) -> tuple[torch.Tensor, float]:
    """The reference delta and its fp32 noise floor: the largest gap to two equally valid runs of it.

    The variants are another summation order (reversed, other microbatching) and every parameter moved by
    one float32 rounding step (as in treetrain.replay.verify.noise_floor, applied to the deltas).
    """
    run = partial(reference_delta, optimizer=optimizer, lora=lora, family=family)
    ref = run(contract, update)
    if contract == "flat":
        other = run("flat", update, flat_microbatch=2)
    else:
        other = run(contract, update, replay=ReplayConfig(contract=contract, microbatch=1, order="reverse"))  # type: ignore[arg-type]
    moved = run(contract, update, perturb=True)
    return ref, max(float((ref - other).norm()), float((ref - moved).norm()))


def pitfall_batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    """Token sequences for the raw several-backward-calls checks; the last one is longer than the rest."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (2, 6 + 6 * (i == n - 1)), generator=gen) for i in range(n)]


def lm_loss(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss (not a mean: every micro-batch keeps its own weight)."""
    logits = model(input_ids=ids).logits[:, :-1]  # [B, T-1, V]
    return (
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        / 100
    )


def uneven_groups() -> list[Group]:
    """One small tree, then five large multi-level ones (each its own group): uneven work for 2 ranks."""
    adv = AdvantageConfig(zero_variance="keep")
    small = SHAPES["unequal"](5)
    large = [SHAPES["multi_level"](20 + s)[0] for s in range(5)]
    return [Group.build(small, adv)] + [Group.build([t], adv) for t in large]


def uneven_owned(update: Sequence[Group], world_size: int, kind: str) -> list[list[set[int]]]:
    """Trajectory ownership per tree and rank. 'uneven': rank 0 replays the first tree, the last rank
    every other tree; 'idle': rank 0 replays everything and the other ranks nothing at all."""
    owned: list[list[set[int]]] = []
    for i, tree in enumerate(t for g in update for t in g.trees):
        per_rank: list[set[int]] = [set() for _ in range(world_size)]
        target = 0 if kind == "idle" or i == 0 else world_size - 1
        per_rank[target] = set(range(len(tree.records)))
        owned.append(per_rank)
    return owned


def settings(
    mode: Mode = "tree",
    microbatch: int | None = 0,
    seed: int = 0,
    loss: LossConfig = LOSS,
    contract: Contract = "exact",
) -> UpdateConfig:
    """The update's settings with the plan's choices forced (tree mode: every sibling in one step)."""
    replay = ReplaySection(
        contract=contract, microbatch=microbatch, chunk_size=0, retention="unbounded", keep_graphs="none"
    )
    return UpdateConfig(
        policy_loss=loss, advantages=AdvantageConfig(zero_variance="keep"), replay=replay, mode=mode,
        memory_budget="64GiB", seed=seed,
    )  # fmt: skip


def rollouts(update: Sequence[Group]) -> list[tuple[Any, ...]]:
    return [g.trees for g in update]


def update(
    learner: Learner, update: Sequence[Group], cfg: UpdateConfig | None = None, **kw: Any
) -> WindowReport:
    """One `run_update` over `update`'s trees; its report."""
    outcome: UpdateOutcome = run_update(learner, cfg or settings(), rollouts(update), **kw)
    assert outcome.report is not None
    return outcome.report
