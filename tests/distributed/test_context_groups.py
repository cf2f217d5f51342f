"""Context groups (`distributed.context_parallel`) under DeepSpeed give the single-process update.

One 4-rank torchrun launch (gloo, CPU) runs every scenario of tests/distributed/context_worker.py: groups
of C = 2 (two data groups) and C = 4 (one), ZeRO 0 and 3, `exact` and `response_only`, a GQA family
(llama), an MLA family (DeepSeek V3), a sliding-window family (Mistral) and hybrids (Qwen3.5: Gated
DeltaNet around attention; Zamba 2: a shared attention block before a Mamba-2 mixer in one layer; Falcon-H1:
attention and Mamba-2 side by side in every layer) and cross-layer KV sharing (Gemma 4: the top half
attends to the bottom half's KV), with varied chunk size and K. Each rank holds only the resident KV it owns.
The SGD deltas are compared with the single-process reference at FACTOR times its measured fp32 noise
floor (`support.dist_cases.delta_floor`): `exact` with the conventional flat run, `response_only` with
itself in one process. Negative controls: the remote pieces left out of the forward merge, or a piece's G
from this rank's share of the output gradient only, are caught by the same comparison.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.context_cases import SCENARIOS
from support.dist_cases import calibrate_first, delta_floor, groups, model_factory, reference_delta
from support.ports import free_port
from support.ports import run as launch

from treetrain.loss.loss_config import LossConfig
from treetrain.models.context_exchange import ContextExchange
from treetrain.replay import ReplayConfig, TreeReplay, UpdateBatch
from treetrain.replay.context_replay import ContextShardingError
from treetrain.replay.resident import ResidentIdentity, ResidentStore

WORKER = Path(__file__).parent / "context_worker.py"
FACTOR = 5.0
TIMEOUT_S = 1500


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("context_groups")
    calibrate_first(
        model_factory(family) for family in dict.fromkeys(s["family"] for s in SCENARIOS.values())
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", str(WORKER), str(out),
    ]  # fmt: skip
    done = launch(cmd, env, TIMEOUT_S)
    (out / "torchrun.log").write_text(done.output)
    if done.returncode is None:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S}s (a deadlock?): {done.output[-3000:]}")
    if done.returncode != 0:
        pytest.fail(f"torchrun failed ({done.returncode}):\n{done.output[-6000:]}")
    return out


def _result(out: Path, name: str) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    errors = sorted(out.glob(f"{name}.error.rank*.txt"))
    if errors:
        pytest.fail(f"scenario {name} raised:\n" + "\n".join(e.read_text()[-3000:] for e in errors))
    info = json.loads((out / f"{name}.json").read_text())["ranks"]
    return load_file(str(out / f"{name}.safetensors"))["delta"], info


@functools.cache
def _reference(family: str, contract: str, chunk: int) -> tuple[torch.Tensor, float]:
    """The single-process delta and its noise floor: `exact`'s is the conventional flat run's;
    `response_only` detaches resident KV, so its update depends on where chunks cut: the same chunking in
    one process, against another summation order and a one-ulp parameter move."""
    if contract == "exact":
        return delta_floor("flat", groups(), family=family)
    run = functools.partial(reference_delta, contract, groups(), family=family)
    ref = run(replay=ReplayConfig(contract="response_only", chunk_size=chunk))
    other = run(
        replay=ReplayConfig(contract="response_only", chunk_size=chunk, microbatch=1, order="reverse")
    )
    moved = run(replay=ReplayConfig(contract="response_only", chunk_size=chunk), perturb=True)
    return ref, max(float((ref - other).norm()), float((ref - moved).norm()))


@functools.cache
def _one_process_resident(family: str, contract: str, chunk: int, k: int) -> int:
    """Peak resident bytes (KV and G) of the same update in one process."""
    model = model_factory(family)()
    store = ResidentStore(ResidentIdentity.of(model))
    peak = [0]
    store.add_listener(lambda *_: peak.__setitem__(0, max(peak[0], store.kv_bytes + store.grad_bytes)))
    update = groups()
    trees = [t for g in update for t in g.trees]
    batch = UpdateBatch.build(trees, [a for g in update for a in g.advantages], LossConfig())
    cfg = ReplayConfig(contract=contract, chunk_size=chunk, microbatch=k)  # type: ignore[arg-type]
    TreeReplay(model, LossConfig(), cfg, store=store).accumulate(batch)
    return peak[0]


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in SCENARIOS if not n.startswith("control")])
def test_context_group_equals_one_process(run: Path, name: str) -> None:
    spec = SCENARIOS[name]
    delta, info = _result(run, name)
    ref, floor = _reference(spec["family"], spec["contract"], spec["chunk"])
    err = float((delta - ref).norm())
    assert err <= FACTOR * floor, f"{name}: |delta - ref| = {err:.3g}, floor {floor:.3g}"
    assert all(r["crossed_bytes"] > 0 for r in info)  # the exchange ran and was counted
    # The per-rank ledger's transfer model is the engine's, to the byte, for every family and shape here.
    assert [r["crossed_bytes"] for r in info] == [r["predicted_bytes"] for r in info], info
    # Sharded, never replicated: no rank holds all of the one-process resident state (a C = 2 group of
    # two data groups replays about half the trees, so only the per-tree share is compared loosely).
    whole = _one_process_resident(spec["family"], spec["contract"], spec["chunk"], spec["k"])
    assert max(r["peak_resident_bytes"] for r in info) < whole, (info, whole)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.startswith("control")])
def test_negative_controls_are_caught(run: Path, name: str) -> None:
    spec = SCENARIOS[name]
    delta, _ = _result(run, name)
    ref, floor = _reference(spec["family"], spec["contract"], spec["chunk"])
    assert float((delta - ref).norm()) > 100 * FACTOR * floor


def test_indexed_sparse_attention_is_refused_at_start() -> None:
    """A family whose attention cannot be split by key set is refused before any compute, with the reason."""
    from transformers import AutoModelForCausalLM

    from treetrain.models.tiny_family import tiny_family_config

    model = AutoModelForCausalLM.from_config(tiny_family_config("deepseek_v32"), attn_implementation="sdpa")
    store = ResidentStore(ResidentIdentity.of(model))
    store.exchange = ContextExchange(size=2, rank=0)  # no collective runs before the refusal
    with pytest.raises(ContextShardingError, match="indexer"):
        TreeReplay(model, LossConfig(), ReplayConfig(contract="exact", chunk_size=4), store=store)
    store.exchange = None
    TreeReplay(model, LossConfig(), ReplayConfig(contract="exact", chunk_size=4), store=store)  # C = 1: fine
