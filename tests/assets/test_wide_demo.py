"""`demo-wide` is the demo policy: the same logits from 64-dimensional heads, and exactly what
`treetrain/assets/make_wide_demo.py` makes from the shipped demo checkpoint."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from treetrain.assets import make_wide_demo
from treetrain.train.models import DEMO_MODEL, WIDE_DEMO_MODEL


def _logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits  # [B, T, V]


def test_the_wide_model_computes_the_demo_models_function() -> None:
    demo = LlamaForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float64)
    wide = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL, dtype=torch.float64)
    assert wide.config.head_dim == 64 and demo.config.head_dim == 16
    ids = torch.randint(0, demo.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(0))
    a, b = _logits(demo, ids), _logits(wide, ids)
    assert (a - b).abs().max() < 1e-5 * a.abs().max()  # float32 weights, float64 arithmetic


def test_the_shipped_files_are_what_the_script_makes() -> None:
    demo = LlamaForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    made = make_wide_demo.widen(demo).state_dict()
    shipped = load_file(str(WIDE_DEMO_MODEL / "model.safetensors"))
    assert set(shipped) <= set(made)
    assert all(torch.equal(made[k], shipped[k]) for k in shipped)


def test_a_wrong_layout_would_show() -> None:
    """Negative control: the rotary pairing and the softmax scale both matter."""
    demo = LlamaForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float64)
    ids = torch.randint(0, demo.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    reference = _logits(demo, ids)
    wide = make_wide_demo.widen(demo)
    for layer in wide.model.layers:  # undo the scale that compensates for the wider softmax scale
        layer.self_attn.q_proj.weight.data /= 2
    assert (_logits(wide, ids) - reference).abs().max() > 1e-2
