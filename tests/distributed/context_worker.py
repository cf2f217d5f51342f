"""Context-group scenarios for tests/distributed/test_context_groups.py: `torchrun --nproc_per_node=4
context_worker.py OUT`.

Each scenario builds a fresh tiny model and DeepSpeed engine, joins context groups of C ranks (C = 2: two
data groups of 2; C = 4: one group of all four) and runs one update (`run_update`) over the same two groups of
trees as the single-process references. Rank 0 writes the parameter delta to OUT/<name>.safetensors and
per-rank facts (peak resident bytes, bytes that crossed ranks) to OUT/<name>.json; a scenario that raises
writes OUT/<name>.error.rank<r>.txt. Negative controls swap the group's exchange for one that leaves the
remote pieces out of the forward merge, or one that gives a piece's G only this rank's share.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from support.context_cases import CONTROLS, SCENARIOS
from support.dist_cases import LOSS, OPTIMIZER, groups, model_factory, params_vector, rollouts

from treetrain.distributed.context_groups import join_context_group
from treetrain.distributed.deepspeed_backend import DeepSpeedBackend
from treetrain.loss.advantages import AdvantageConfig
from treetrain.replay.resident import ResidentIdentity, ResidentStore
from treetrain.update.learner import Learner
from treetrain.update.run import run_update
from treetrain.update.settings import ReplaySection, UpdateConfig

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
ONLY = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else None


def current(backend: DeepSpeedBackend) -> torch.Tensor:
    params = list(backend.module.parameters())
    gathered = deepspeed.zero.GatheredParameters(params) if backend.zero_stage == 3 else nullcontext()
    with gathered:
        return params_vector(backend.module)


def scenario(name: str, spec: dict[str, Any]) -> None:
    started = time.monotonic()
    model = model_factory(spec["family"])()
    backend = DeepSpeedBackend(model, zero_stage=spec["stage"], optimizer=OPTIMIZER)
    join_context_group(backend, spec["size"])
    control = spec.get("control")
    if control is not None:
        assert backend.context is not None
        backend.context = CONTROLS[control](backend.context.size, backend.context.rank, backend.context.group)
    start = current(backend)
    store = ResidentStore(ResidentIdentity.of(backend.module))
    peak = [0]

    def listen(kind: str, key: Any, delta: int) -> None:
        peak[0] = max(peak[0], store.kv_bytes + store.grad_bytes)

    store.add_listener(listen)
    replay = ReplaySection(
        contract=spec["contract"], microbatch=spec["k"], chunk_size=spec["chunk"], retention="unbounded",
        keep_graphs="none",
    )  # fmt: skip
    cfg = UpdateConfig(
        policy_loss=LOSS, advantages=AdvantageConfig(zero_variance="keep"), replay=replay, mode="tree",
        memory_budget="64GiB",
    )  # fmt: skip
    outcome = run_update(Learner(backend, store=store), cfg, rollouts(groups()))
    assert outcome.report is not None
    delta = current(backend) - start
    assert backend.context is not None
    info = dict(
        peak_resident_bytes=peak[0],
        crossed_bytes=backend.context.counts.total_bytes,
        predicted_bytes=outcome.predicted_context_bytes,
        seconds=round(time.monotonic() - started, 2),
    )
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, info)
    if dist.get_rank() == 0:
        save_file({"delta": delta.contiguous()}, str(OUT / f"{name}.safetensors"))
        (OUT / f"{name}.json").write_text(json.dumps({"ranks": everyone}))


def main() -> None:
    for name, spec in SCENARIOS.items():
        if ONLY is not None and name not in ONLY:
            continue
        try:
            scenario(name, spec)
        except Exception:
            rank = int(os.environ.get("RANK", "0"))
            (OUT / f"{name}.error.rank{rank}.txt").write_text(traceback.format_exc())
        dist.barrier()


if __name__ == "__main__":
    main()
