"""What an inference engine receives after a step: full weights under the base checkpoint's names, LoRA
merged for the copy and unmerged after (ZeRO-2/3 are in tests/distributed/test_distributed.py)."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from support.env_fixtures import tiny_model

from treetrain.rollout.engines.served_checkpoint import write_weights
from treetrain.rollout.engines.weight_buckets import weight_buckets


def _lora() -> torch.nn.Module:
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)  # adapters that change the function
    return model


def test_lora_weights_arrive_merged_under_the_base_names() -> None:
    model = _lora()
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(ids).logits.detach()
    got = {name: t.clone() for bucket in weight_buckets(model, bucket_bytes=4096) for name, t in bucket}
    assert set(got) == set(expected)  # lm_head.weight too: the engine reloads the head from it
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    base = tiny_model().state_dict()
    assert not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(model(ids).logits.detach(), before)  # unmerged again: training goes on unchanged


def test_a_plain_model_streams_its_own_tensors_in_bounded_buckets(tmp_path: object) -> None:
    model = tiny_model()
    buckets = list(weight_buckets(model, bucket_bytes=20_000))
    assert len(buckets) > 2
    assert {n for b in buckets for n, _ in b} == set(model.state_dict())
    written = write_weights(model, tmp_path)  # type: ignore[arg-type]
    loaded: dict[str, torch.Tensor] = {}
    for file in written.glob("*.safetensors"):
        loaded.update(load_file(str(file)))
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
