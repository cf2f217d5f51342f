"""Hybrid families over the layer counts and patterns real checkpoints can have: each is accepted (the
split probe agrees with the whole forward at float32 rounding) or refused with a one-line reason, never an
internal error from a probe.

Zamba and Zamba 2 build a Mamba block for every layer type but 'hybrid', so a config that names a layer
'full_attention' has a Mamba layer there; the engine reads the layers as built (`recurrent_layers`), and
the negative control shows the same probe refuses these patterns once the resident state is wrong."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from treetrain.models.decoder import decoder_layers
from treetrain.models.recurrent_kinds import kind_of
from treetrain.models.recurrent_state import EngineCache, hybrid_layers, recurrent_layers
from treetrain.models.support import UnsupportedModelError, check_supported
from treetrain.models.tiny_family import tiny_family_config

PATTERNS: list[tuple[str, dict[str, Any]]] = [
    ("zamba2", dict(num_hidden_layers=1, layers_block_type=["hybrid"])),
    ("zamba2", dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"])),
    ("zamba2", dict(num_hidden_layers=2, layers_block_type=["mamba", "full_attention"])),
    ("zamba2", dict(num_hidden_layers=2, layers_block_type=["full_attention", "hybrid"])),
    ("zamba2", dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "full_attention"])),
    ("zamba2", dict(num_hidden_layers=5, layers_block_type=["mamba", "hybrid", "mamba", "mamba", "hybrid"])),
    ("zamba", dict(num_hidden_layers=1, layers_block_type=["mamba"])),
    ("zamba", dict(num_hidden_layers=2, layers_block_type=["mamba", "full_attention"])),
    ("zamba", dict(num_hidden_layers=2, layers_block_type=["hybrid", "hybrid"])),
    ("zamba", dict(num_hidden_layers=3, layers_block_type=["full_attention", "hybrid", "mamba"])),
    ("zamba", dict(num_hidden_layers=5)),  # the config's own pattern: mamba, mamba, hybrid, mamba, hybrid
    ("qwen3_next", dict(num_hidden_layers=1, layer_types=["full_attention"])),
    ("qwen3_next", dict(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])),
    ("bamba", dict(num_hidden_layers=1, attn_layer_indices=[0])),
    ("bamba", dict(num_hidden_layers=5, attn_layer_indices=[4])),
    ("jamba", dict(num_hidden_layers=1, attn_layer_period=1, attn_layer_offset=0, expert_layer_offset=0)),
    ("nemotron_h", dict(num_hidden_layers=2, layers_block_type=["attention", "mamba"])),
    ("granitemoehybrid", dict(num_hidden_layers=2, layer_types=["attention", "mamba"])),
]


def _model(family: str, changes: dict[str, Any]) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            tiny_family_config(family, changes), attn_implementation="sdpa"
        )
    return model.eval()


def _built_recurrent(model: PreTrainedModel) -> set[int]:
    """Blocks that hold a recurrent mixer, read from the modules the model built."""
    return {i for i, block in enumerate(decoder_layers(model)) if any(kind_of(m) for m in block.modules())}


def _case_id(case: tuple[str, dict[str, Any]]) -> str:
    family, changes = case
    pattern = changes.get("layers_block_type") or changes.get("layer_types") or ""
    return f"{family}-{changes['num_hidden_layers']}-{'-'.join(pattern)}"


@pytest.mark.parametrize("case", PATTERNS, ids=[_case_id(c) for c in PATTERNS])
def test_a_hybrid_layer_pattern_is_accepted_as_built(case: tuple[str, dict[str, Any]]) -> None:
    model = _model(*case)
    assert set(recurrent_layers(model)) == _built_recurrent(model)
    check_supported(model, 64)  # raises the refusal, one line, if the split changes anything


def test_a_layer_named_attention_that_zamba_builds_as_mamba_is_read_as_mamba() -> None:
    model = _model(
        "zamba2", dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "full_attention"])
    )
    assert sorted(recurrent_layers(model)) == [0, 1, 2] and sorted(hybrid_layers(model)) == [1]


def test_negative_control_the_same_patterns_are_refused_when_the_resident_state_is_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A conv window of zeros in place of the resident one: the split probe must catch it on these
    patterns, so their acceptance above is a measurement, not a probe that cannot fail."""
    original = EngineCache.get_conv_state

    def zeroed(self: EngineCache, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        got = original(self, layer_idx, state_idx)
        return None if got is None else torch.zeros_like(got)

    monkeypatch.setattr(EngineCache, "get_conv_state", zeroed)
    for family, changes in PATTERNS[1:3]:
        with pytest.raises(
            UnsupportedModelError, match="continuing from stored KV changes the hidden states"
        ):
            check_supported(_model(family, changes), 64)
