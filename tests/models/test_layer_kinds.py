"""The support table's tiny models carry their families' distinctive layers, as the published configs
have them: every layer kind the family's decoder layers can construct (attention, conv, recurrent mixers,
indexers, experts: `treetrain.models.layer_kinds`, read from the modeling code), every per-layer type of
the family's default config, and a sliding window or attention chunk the support check's probe crosses.
Checked for every family the page accepts, on meta-device models (no weights, a few seconds in all); the
negative controls are tiny configs without that care, which the same checks catch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

import treetrain.models.tiny_family as tiny_family
from treetrain.models.layer_kinds import layer_types, missing_kinds
from treetrain.models.support_table import PROBE, support_row
from treetrain.models.tiny_family import tiny_family_config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "model-support.md"
#: Kinds a family's code can build that its published checkpoints do not use, and why the table's row
#: leaves them out.
ALTERNATIVES: dict[str, dict[str, str]] = {
    "doge": {
        "DogeCDMoE": "the default and the published Doge checkpoints are dense (`is_moe=False`); with CDMoE "
        "its router mixes logits across tokens (transformers says so), which the support check refuses as "
        "not causal (test_doge_with_cdmoe_is_refused_as_not_causal)"
    },
}


def _accepted() -> list[str]:
    rows = [line.split(" | ") for line in PAGE.read_text().splitlines() if line.startswith("| `")]
    return [row[0].strip("|` ") for row in rows if row[1] == "accepted"]


def _meta(config: PretrainedConfig) -> PreTrainedModel:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _lacks(family: str, config: PretrainedConfig) -> list[str]:
    """What the tiny config lacks of the family's distinctive layers, one phrase each."""
    lacks = [f"layer kind {k}" for k in missing_kinds(_meta(config)) if k not in ALTERNATIVES.get(family, {})]
    lacks += [
        f"layer type {t!r}" for t in sorted(layer_types(AutoConfig.for_model(family)) - layer_types(config))
    ]
    text = config.get_text_config(decoder=True)
    for name in ("sliding_window", "attention_chunk_size"):
        size = getattr(text, name, None)
        if isinstance(size, int) and size >= PROBE:
            lacks.append(f"{name} {size}, which the {PROBE}-token probe does not cross")
    return lacks


def test_every_accepted_family_is_checked_with_its_distinctive_layers() -> None:
    accepted = _accepted()
    assert len(accepted) > 100  # the page's accepted rows, not an empty read
    lacking = {f: lacks for f in accepted if (lacks := _lacks(f, tiny_family_config(f)))}
    assert not lacking, f"tiny configs without their family's distinctive layers: {lacking}"


@pytest.mark.parametrize(
    ("family", "lack"),
    [
        ("lfm2", "layer kind Lfm2ShortConv"),  # the config's default: attention only
        ("qwen3_next", "layer kind Qwen3NextAttention"),  # two layers of its pattern: linear attention only
        ("mistral", "sliding_window 4096"),
        ("flint", "layer kind FlintSparseMoeBlock"),  # its two dense-first layers
    ],
)
def test_negative_control_a_generic_tiny_config_lacks_them(family: str, lack: str) -> None:
    generic = tiny_family._config(family, dict(tiny_family._COMMON))
    assert any(item.startswith(lack) for item in _lacks(family, generic))


def test_the_row_says_what_the_tiny_model_held() -> None:
    row = support_row("lfm2")
    assert row.status == "refused" and "conv" in row.tiny and "conv" in row.note
    assert "window 6" in support_row("mistral").tiny


def test_doge_with_cdmoe_is_refused_as_not_causal() -> None:
    row = support_row("doge", dict(is_moe=True, num_experts=16, num_experts_per_tok=2))
    assert row.status == "refused" and "not causal" in row.note
