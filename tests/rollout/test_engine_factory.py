"""The engine factory (`treetrain.rollout.engines.factory`): every engine-specific refusal is one line at
start naming the setting, each beside a control that the same spec without the fault passes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.env_fixtures import tiny_model

from treetrain.errors import ConfigError
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.factory import EngineSpec, check_engine, make_engine
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.rollout.engines.server_ranks import TrainerRanks

MODEL = tiny_model()
SPEC = EngineSpec(
    "hf", VLLMSettings(), run_dir="/tmp", model_path="tiny-llama", checkpoint="tiny-llama", max_tokens=256
)


class _Fused(torch.nn.Module):
    """A model keeping its experts as one 3-D stack, as transformers' MoE layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.Parameter(torch.zeros(2, 3, 3))


def test_vllm_server_takes_several_trainer_processes() -> None:
    ranks = TrainerRanks(0, 2, lambda text: [text, ""])
    spec = replace(SPEC, kind="vllm-server", world_size=2, ranks=ranks)
    check_engine(spec, MODEL)  # synchronous: rank 0 leads each sync
    with pytest.raises(ConfigError, match=r"needs the ranks' gather"):
        check_engine(replace(spec, ranks=None), MODEL)
    # asynchronous: rank 0's sampler is the fleet's one client, with no gather of its own
    check_engine(replace(spec, ranks=None, in_flight_weights=True), MODEL)
    check_engine(replace(spec, world_size=1, ranks=None, in_flight_weights=True), MODEL)  # one process


@pytest.mark.parametrize("kind", ["vllm", "vllm-server"])
def test_fused_experts_and_lora_under_zero3_are_refused_for_checkpoint_engines(
    kind: str, tmp_path: Path
) -> None:
    spec = replace(SPEC, kind=kind, checkpoint=str(tmp_path))
    with pytest.raises(
        ConfigError, match=rf"^rollout.engine: '{kind}' loads checkpoint-named weights, .* experts"
    ):
        check_engine(spec, _Fused())
    with pytest.raises(
        ConfigError, match=rf"^rollout.engine: '{kind}' with LoRA under ZeRO-3 is not supported"
    ):
        check_engine(replace(spec, lora_under_zero3=True), MODEL)
    check_engine(spec, MODEL)  # control: neither
    check_engine(replace(spec, kind="hf", lora_under_zero3=True), _Fused())  # the hf engine takes both


def test_vllm_needs_a_checkpoint_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.path='tiny-llama' is a built-in preset; save it"):
        check_engine(replace(SPEC, kind="vllm"), MODEL)
    check_engine(replace(SPEC, kind="vllm", checkpoint=str(tmp_path)), MODEL)  # control


def test_an_unknown_engine_is_refused_and_hf_gets_its_kv_budget() -> None:
    with pytest.raises(ConfigError, match=r"^rollout.engine: must be one of"):
        replace(SPEC, kind="sglang")
    engine = make_engine(replace(SPEC, hf_kv_bytes=12345), MODEL)
    assert isinstance(engine, HFEngine) and engine.max_kv_bytes == 12345 and engine.version == -1
