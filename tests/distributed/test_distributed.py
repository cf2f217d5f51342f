"""DeepSpeed across 2 processes (gloo, CPU) gives the single-process update, exactly once, under faults.

One `torchrun` launch runs every scenario of tests/distributed/worker.py (a fresh DeepSpeed engine each);
the tests below compare the parameter deltas it wrote with single-process references computed here with
plain torch (`tests/support/dist_cases.py`). The deltas are SGD steps (delta = -lr * g), so the gradient's scale
is checked, not only its direction; one AdamW case per stage checks the AdamW path. The tolerance is
FACTOR times the reference's measured fp32 noise floor (another summation order, and a one-ulp parameter
move), as in test_replay_exact.py. Negative controls show the same comparison rejects a doubled or a
skipped contribution, a gradient without the rescale over ranks (half the update), and naive DeepSpeed use.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.dist_cases import (
    ADAMW,
    OPTIMIZER,
    RECURRENT_DIST,
    STAGES,
    calibrate_first,
    delta_floor,
    groups,
    lm_loss,
    make_lora_model,
    make_model,
    model_factory,
    params_vector,
    pitfall_batches,
    uneven_groups,
)
from support.ports import free_port
from support.ports import run as launch

from treetrain.distributed import TorchBackend
from treetrain.memory.persistent import largest_module, model_persistent_bytes
from treetrain.replay.verify import _perturb

pytestmark = pytest.mark.distributed
FACTOR = 5.0
WORKER = Path(__file__).parent / "worker.py"
TIMEOUT_S = 900  # a deadlock fails the test; a loaded machine needs minutes for every scenario
CRASHED = re.compile(r"exitcode\s*:\s*-(?!15\b)\d+")
"""torchrun's report of a rank killed by a signal other than its own SIGTERM to the other ranks."""
FAULTS = (
    "fault_before_backward",
    "fault_after_backward_started",
    "fault_mid_backward",
    "oom",
    "duplicate",
    "order",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every scenario, in one 2-rank torchrun launch."""
    out = tmp_path_factory.mktemp("distributed")
    calibrate_first([model_factory(f) for f in ("llama", *RECURRENT_DIST)] + [make_lora_model])
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")

    def command() -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(WORKER), str(out),
        ]  # fmt: skip

    start = time.monotonic()
    done = launch(command(), env, TIMEOUT_S)
    (out / "torchrun.log").write_text(done.output)
    if done.returncode and CRASHED.search(done.output):
        # A rank died of a signal inside torch or gloo (a scenario's own errors are caught and written by
        # the worker): said as a warning, and the scenarios it had not finished run in a second launch.
        warnings.warn(
            f"torchrun: a rank crashed, its unfinished scenarios run again:\n{done.output[-1500:]}",
            stacklevel=1,
        )
        done = launch(command(), env, TIMEOUT_S)
        (out / "torchrun-relaunch.log").write_text(done.output)
    if done.returncode is None:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S}s (a deadlock?): {done.output[-3000:]}")
    print(f"\ndistributed worker: {time.monotonic() - start:.1f}s wall for every scenario")
    if done.returncode != 0:
        pytest.fail(f"torchrun failed ({done.returncode}):\n{done.output[-6000:]}")
    return out


def _result(out: Path, name: str) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    errors = sorted(out.glob(f"{name}.error.rank*.txt"))
    if errors:
        pytest.fail(f"scenario {name} raised:\n" + "\n".join(e.read_text()[-3000:] for e in errors))
    info = json.loads((out / f"{name}.json").read_text())["ranks"]
    return load_file(str(out / f"{name}.safetensors"))["delta"], info


@pytest.fixture(scope="module")
def flat_ref() -> tuple[torch.Tensor, float]:
    return delta_floor("flat", groups())


def _close(delta: torch.Tensor, ref: tuple[torch.Tensor, float], what: str) -> None:
    expected, floor = ref
    assert float(expected.norm()) > 1e-3, "the reference update is empty"
    err = float((delta - expected).norm())
    assert err <= FACTOR * floor, f"{what}: |delta - reference| = {err:.3e} > {FACTOR} x floor {floor:.3e}"


def _far(delta: torch.Tensor, ref: tuple[torch.Tensor, float], what: str) -> float:
    """For negative controls: the error must be far outside the tolerance; returns error / floor."""
    err = float((delta - ref[0]).norm())
    assert err > 100 * FACTOR * ref[1], f"{what}: {err:.3e} is not far above the floor {ref[1]:.3e}"
    return err / ref[1]


@pytest.mark.parametrize("stage", list(STAGES))
def test_exact_matches_single_process_flat(
    run: Path, flat_ref: tuple[torch.Tensor, float], stage: str
) -> None:
    delta, info = _result(run, f"{stage}-exact")
    _close(delta, flat_ref, f"{stage} exact")
    assert all(r["version"] == 1 for r in info)
    assert all((r["zero_stage"], r["offload_optimizer"]) == STAGES[stage] for r in info)


@pytest.fixture(scope="module")
def adamw_ref() -> tuple[torch.Tensor, float]:
    return delta_floor("flat", groups(), ADAMW)


@pytest.mark.parametrize("stage", list(STAGES))
def test_adamw_matches_single_process_flat(
    run: Path, adamw_ref: tuple[torch.Tensor, float], stage: str
) -> None:
    delta, _ = _result(run, f"{stage}-adamw")
    _close(delta, adamw_ref, f"{stage} adamw")


@pytest.mark.parametrize("stage", list(STAGES))
def test_negative_control_without_the_rescale_the_update_is_halved(
    run: Path, flat_ref: tuple[torch.Tensor, float], stage: str
) -> None:
    """DeepSpeed averages over the 2 ranks; without the backend's x2 the SGD step is exactly half."""
    delta, _ = _result(run, f"{stage}-no_rescale")
    ratio = _far(delta, flat_ref, f"{stage} without rescale")
    print(f"{stage} no_rescale: |delta - reference| = {ratio:.0f} x floor")
    _close(delta, (flat_ref[0] / 2, flat_ref[1]), f"{stage} without rescale vs half the reference")


@pytest.fixture(scope="module")
def response_only_ref() -> tuple[torch.Tensor, float]:
    return delta_floor("response_only", groups())


@pytest.mark.parametrize("stage", list(STAGES))
def test_response_only_matches_its_single_process_reference(
    run: Path, response_only_ref: tuple[torch.Tensor, float], stage: str
) -> None:
    delta, _ = _result(run, f"{stage}-response_only")
    _close(delta, response_only_ref, f"{stage} response_only")


def test_placements_differ_between_scenarios(run: Path) -> None:
    """z1/z3 use round-robin (every tree split: ancestors recomputed on both ranks), the others the planner."""
    planner = _result(run, "z2-exact")[1][0]["duplicated_tokens"]
    split = _result(run, "z3-exact")[1][0]["duplicated_tokens"]
    assert split > planner


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_faults_keep_the_update_exact(
    run: Path, flat_ref: tuple[torch.Tensor, float], stage: str, fault: str
) -> None:
    delta, info = _result(run, f"{stage}-{fault}")
    _close(delta, flat_ref, f"{stage} {fault}")
    r0, r1 = info
    if fault == "fault_before_backward":
        assert r0["tree_retries"] == 1 and r0["window_resets"] == 0
    elif fault == "fault_after_backward_started":
        assert r1["window_resets"] == 1 and r0["window_resets"] == 0
    elif fault == "fault_mid_backward":
        assert r0["window_resets"] == 1 and r1["window_resets"] == 0
    elif fault == "oom":
        assert r0["oom_splits"] + r1["oom_splits"] >= 1
    elif fault == "duplicate":
        assert all(r["refused"] and "already covered" in r["refused"][0] for r in info)


def test_failed_group_is_dropped_whole(run: Path, flat_ref: tuple[torch.Tensor, float]) -> None:
    delta, info = _result(run, "z2-drop_group")
    assert all(len(r["dropped"]) == 1 and r["dropped"][0][0] == 1 for r in info)
    assert "injected persistent failure" in info[0]["dropped"][0][1]
    _close(delta, delta_floor("flat", groups()[:1]), "group 1 dropped")
    assert float((delta - flat_ref[0]).norm()) > 100 * FACTOR * flat_ref[1]


def test_version_mismatch_and_stale_reads_are_refused(
    run: Path, flat_ref: tuple[torch.Tensor, float]
) -> None:
    delta, info = _result(run, "z2-stale")
    for r in info:
        assert "ranks [1] differ" in r["version_mismatch"] and "model_version=1" in r["version_mismatch"]
        assert "invalidated by an optimizer step" in r["stale_new_identity"]
        assert "store holds identity" in r["stale_old_identity"]
    _close(delta, flat_ref, "window after the refused mismatched one")


def test_coverage_check_refuses_doubled_and_missing_contributions(run: Path) -> None:
    delta, info = _result(run, "z2-coverage")
    for r in info:
        assert "covered more than once" in r["doubled"] and "ranks [0, 1]" in r["doubled"]
        assert "1 missing" in r["missing"]
    assert float(delta.abs().max()) == 0.0, "a refused step must not move the parameters"


@pytest.mark.parametrize("kind", ["double", "skip"])
def test_negative_control_bypassing_the_ledger_is_numerically_visible(
    run: Path, flat_ref: tuple[torch.Tensor, float], kind: str
) -> None:
    delta, _ = _result(run, f"z2-{kind}")
    _far(delta, flat_ref, kind)


@pytest.mark.parametrize("stage", ["z2", "z3", "z2off"])
def test_resume_reproduces_the_next_update(run: Path, stage: str) -> None:
    """AdamW (its moments must survive), loaded with weights-only unpickling."""
    delta, info = _result(run, f"{stage}-resume")
    for r in info:
        assert r["loaded_equals_saved"] and r["client_state"] == {"version": 1, "update": 1}
        assert r["resumed_vs_original"] == 0.0
        if stage == "z2":
            assert "refused by weights-only loading" in r["tampered"]
            assert "Unsupported global: GLOBAL print" in r["tampered"]
    assert info[0]["export_equals_weights"] and "model.safetensors" in info[0]["export_files"]
    assert float(delta.abs().max()) == 0.0
    assert not list(run.glob(".ckpt-*")) and not list(run.glob(".export-*")), "temporary directories left"
    assert "Payload unpickled" not in (run / "torchrun.log").read_text(), "the planted payload ran"


def _pitfall_ref(perturb: bool = False, reverse: bool = False) -> torch.Tensor:
    model = make_model()
    if perturb:
        _perturb(model, seed=99)
    base = params_vector(make_model())
    backend = TorchBackend(model, OPTIMIZER)
    batches = pitfall_batches(4)
    for ids in reversed(batches) if reverse else batches:
        backend.backward(lm_loss(model, ids))
    backend.step()
    return params_vector(model) - base


@pytest.fixture(scope="module")
def pitfall_ref() -> tuple[torch.Tensor, float]:
    ref = _pitfall_ref()
    floor = max(
        float((ref - _pitfall_ref(reverse=True)).norm()), float((ref - _pitfall_ref(perturb=True)).norm())
    )
    return ref, floor


@pytest.mark.parametrize("stage", ["z1", "z2", "z2off", "z3"])
def test_several_backward_calls_per_step_all_count(
    run: Path, pitfall_ref: tuple[torch.Tensor, float], stage: str
) -> None:
    """Uneven micro-batch counts (3 and 1), the last one the largest, a second backward under ZeRO-3."""
    delta, info = _result(run, f"{stage}-several_backward")
    assert [r["backward_calls"] for r in info] == [3, 1]
    _close(delta, pitfall_ref, f"{stage} several backward calls")


def test_negative_control_naive_deepspeed_drops_micro_batches(
    run: Path, pitfall_ref: tuple[torch.Tensor, float]
) -> None:
    """engine.backward per micro-batch then engine.step (ZeRO-1, GAS=1) keeps only part of the gradient."""
    delta, _ = _result(run, "z1-several_backward_naive")
    _far(delta, pitfall_ref, "naive DeepSpeed")


@pytest.fixture(scope="module")
def lora_ref() -> tuple[torch.Tensor, float]:
    return delta_floor("flat", groups(), lora=True)


@pytest.mark.parametrize("stage", ["z0", "z1", "z2", "z3"])
def test_lora_matches_single_process_flat(
    run: Path, lora_ref: tuple[torch.Tensor, float], stage: str
) -> None:
    """Only adapters train (KL against adapters off); the base does not move and never holds a gradient."""
    delta, info = _result(run, f"{stage}-lora")
    _close(delta, lora_ref, f"{stage} lora")
    model = make_lora_model()
    frozen = torch.cat([torch.full((p.numel(),), not p.requires_grad) for p in model.parameters()])
    assert float(delta[frozen].abs().max()) == 0.0 and float(delta[~frozen].abs().max()) > 0
    for r in info:
        assert r["only_adapters"] and r["trainable"] and r["frozen_with_grad"] == []
        assert r["version"] == 1 and r["zero_stage"] == int(stage[1])


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_lora_resume_reproduces_the_next_update_and_exports_the_adapter(run: Path, stage: str) -> None:
    delta, info = _result(run, f"{stage}-lora_resume")
    for r in info:
        assert r["loaded_equals_saved"] and r["resumed_vs_original"] == 0.0 and r["moved"] > 0
    assert info[0]["export_equals_weights"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(info[0]["export_files"])
    assert float(delta.abs().max()) == 0.0


@pytest.fixture(scope="module")
def uneven_ref() -> tuple[torch.Tensor, float]:
    return delta_floor("flat", uneven_groups())


@pytest.mark.parametrize("stage", ["z1", "z2", "z3"])
def test_uneven_work_matches_single_process_flat(
    run: Path, uneven_ref: tuple[torch.Tensor, float], stage: str
) -> None:
    """Rank 0 replays one small tree, rank 1 five large ones: different numbers of forwards, backwards
    and (under ZeRO-3) parameter fetches, the same update."""
    delta, info = _result(run, f"{stage}-uneven")
    _close(delta, uneven_ref, f"{stage} uneven")
    light, heavy = info
    assert light["steps"] < heavy["steps"] and light["rank_tokens"] == heavy["rank_tokens"]
    assert heavy["imbalance"] == pytest.approx(2 * max(heavy["rank_tokens"]) / sum(heavy["rank_tokens"]))
    if stage == "z3":
        assert light["served"] > heavy["served"], "the idle rank must take part in the busy rank's fetches"


@pytest.mark.parametrize("stage", ["z1", "z2", "z3"])
def test_a_rank_without_work_still_makes_the_update(
    run: Path, flat_ref: tuple[torch.Tensor, float], stage: str
) -> None:
    delta, info = _result(run, f"{stage}-idle")
    _close(delta, flat_ref, f"{stage} with rank 1 idle")
    busy, idle = info
    assert busy["steps"] > 0 and idle["steps"] == 0
    assert idle["rank_tokens"][1] == 0 and idle["imbalance"] == 2.0


def test_engine_weight_sync_streams_full_weights_without_gathering_the_model(run: Path) -> None:
    """`weight_buckets` (what vLLM receives after each step) gives every parameter in full under ZeRO-2 and
    ZeRO-3; under ZeRO-3 a rank holds its partition plus one module while the weights stream."""
    for stage in ("z2", "z3"):
        for r in _result(run, f"{stage}-weight_sync")[1]:
            assert r["equal"] and r["names"], (stage, r)
    for r in _result(run, "z3-weight_sync")[1]:
        assert r["full"] / 2 < r["peak"] <= r["full"] / 2 + r["largest"] + 1024, r  # partition + one module
    for r in _result(run, "z2-weight_sync")[1]:
        assert r["peak"] == r["full"]  # negative control: ZeRO-2 holds it all


@pytest.mark.parametrize("scenario", ["z3-gathered_feed", "z3-gathered_feed_lora"])
def test_zero3_async_hf_feed_fills_one_shadow_from_gathered_modules(run: Path, scenario: str) -> None:
    """Under ZeRO-3 an asynchronous `hf` run samples on rank 0 alone: its shadow (host shared memory, no
    DeepSpeed bookkeeping, so it pickles to the sampler process) equals the gathered parameters after one
    publish that both ranks run (a LoRA policy's adapters too), rank 1 keeps no shadow, and no module stays
    gathered after it."""
    zero, one = _result(run, scenario)[1]
    assert (one["holds"], one["released"]) == (False, True), one
    checks = ("holds", "released", "names", "equal", "own_storage", "shared", "pickles")
    assert all(zero[c] is True for c in checks), zero


def test_zero3_keeps_parameters_partitioned_during_the_window(run: Path) -> None:
    """Measured parameter storage per rank during the window: ZeRO-2 holds the whole model; ZeRO-3 holds
    its partition (half) plus what is in flight, within what the ledger books (partition + in flight)."""
    model = make_model()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    padding = 4 * len(list(model.parameters()))  # DeepSpeed pads each parameter to a multiple of W
    largest = 4 * largest_module(model)
    booked = model_persistent_bytes(model, zero_stage=3, world_size=2)
    assert booked.in_flight == 2 * largest
    for r in _result(run, "z2-uneven")[1]:
        assert r["param_sampled_bytes"] == full == model_persistent_bytes(model, zero_stage=2).params
    for r in _result(run, "z3-uneven")[1] + _result(run, "z3-idle")[1]:
        assert r["rounds"] > 0
        assert booked.params <= r["partition_bytes"] <= booked.params + padding
        assert r["partition_bytes"] + largest <= r["param_peak_bytes"]
        assert r["param_peak_bytes"] <= booked.params + booked.in_flight + padding


@functools.cache
def _recurrent_ref(family: str, contract: str) -> tuple[torch.Tensor, float]:
    return delta_floor(contract, groups(), family=family)


@pytest.mark.parametrize("stage", ["z0", "z1", "z2", "z3"])
@pytest.mark.parametrize("family", RECURRENT_DIST)
def test_recurrent_exact_matches_single_process_flat(run: Path, family: str, stage: str) -> None:
    """Gated DeltaNet and Mamba-2 layers beside attention: their resident (conv state, recurrent state)
    carries G like KV, with every tree split over both ranks (ancestors recomputed on each)."""
    delta, info = _result(run, f"{stage}-exact-{family}")
    _close(delta, _recurrent_ref(family, "flat"), f"{stage} exact {family}")
    assert all(r["version"] == 1 and r["zero_stage"] == int(stage[1]) and not r["dropped"] for r in info)
    assert all(r["tree_retries"] == 0 and r["window_resets"] == 0 for r in info), info


@pytest.mark.parametrize("family", RECURRENT_DIST)
def test_recurrent_zero3_stays_partitioned(run: Path, family: str) -> None:
    """Under ZeRO-3 a rank holds its partition plus what is in flight, as the ledger books it."""
    model = model_factory(family)()
    booked = model_persistent_bytes(model, zero_stage=3, world_size=2)
    padding = 4 * len(list(model.parameters()))  # DeepSpeed pads each parameter to a multiple of W
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    for r in _result(run, f"z3-exact-{family}")[1]:
        assert r["rounds"] > 0
        assert booked.params <= r["partition_bytes"] <= booked.params + padding
        assert r["partition_bytes"] < r["param_peak_bytes"] <= booked.params + booked.in_flight + padding
        assert r["param_peak_bytes"] < full, "the whole model was gathered"


def test_recurrent_zero3_calibrates_with_its_convolution_weights_held(run: Path) -> None:
    """A recurrent mixer's one-token step reads `conv1d.weight` without calling `conv1d`; under ZeRO-3 that
    read the empty partition (an IndexError in the calibration's probes, whose single-token steps follow a
    recurrent past) until the backend held those weights gathered through the window (`DirectReads`).
    Gated DeltaNet here; Mamba-2's mixer (Nemotron-H) reads its weight the same way."""
    name = "z3-calibrate-qwen3_5_text"
    errors = sorted(run.glob(f"{name}.error.rank*.txt"))
    assert not errors, errors[0].read_text()[-3000:]
    info = json.loads((run / f"{name}.json").read_text())["ranks"]
    assert all(r["samples"] > 0 and r["held"] > 0 for r in info), info


@pytest.mark.parametrize("family", RECURRENT_DIST)
def test_recurrent_response_only_under_zero3_detaches_the_resident_state(run: Path, family: str) -> None:
    """It matches its own single-process reference and, as a negative control, is far from flat's: the
    check above sees the gradient that crosses the resident state (recurrent and KV)."""
    delta, _ = _result(run, f"z3-response_only-{family}")
    _close(delta, _recurrent_ref(family, "response_only"), f"z3 response_only {family}")
    ratio = _far(delta, _recurrent_ref(family, "flat"), f"z3 response_only {family} vs flat")
    print(f"{family} z3 response_only: |delta - flat| = {ratio:.0f} x floor")
