"""The engine's grouped-query attention against resident KV: same result, no per-head copy of the past."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import treetrain.models.decoder as decoder
from treetrain.models.attention import NAME, engine_attention
from treetrain.models.decoder import decoder_forward
from treetrain.models.presets import TinySize, tiny_model

SIZE = TinySize(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=64)
PAST, NEW = 40, 6


class _Shapes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, ...]]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, PAST + NEW), generator=gen)
    pos = torch.arange(PAST + NEW)[None].expand(2, -1)
    with torch.no_grad():
        first = decoder_forward(model, ids[:1, :PAST], pos[:1, :PAST], None)
    past = [
        (k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in zip(first.keys, first.values)
    ]
    with _Shapes() as probe:
        out = decoder_forward(model, ids[:, PAST:], pos[:, PAST:], past)
        out.hidden.square().sum().backward()
    return out.hidden.detach(), past[0][0].grad.clone(), probe.shapes


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_grouped_query_attention_matches_the_model_and_never_repeats_the_past(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(family, 64, size=SIZE, dtype=torch.float64)
    hidden, grad, shapes = _run(model)
    assert model.config._attn_implementation == "sdpa"  # restored after every forward
    head_dim = model.config.head_dim
    repeated = (2, SIZE.num_heads, PAST + NEW, head_dim)
    assert repeated not in shapes, "the past was expanded to every query head"

    import contextlib

    monkeypatch.setattr(decoder, "engine_attention", lambda m: contextlib.nullcontext())
    ref_hidden, ref_grad, ref_shapes = _run(model)
    assert repeated in ref_shapes  # the control: Hugging Face's own sdpa path does expand it
    assert torch.allclose(hidden, ref_hidden, rtol=0, atol=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-12)


def test_only_sdpa_models_are_switched_and_the_setting_is_restored() -> None:
    eager = tiny_model("llama", 64, size=SIZE, attn="eager")
    with engine_attention(eager):
        assert eager.config._attn_implementation == "eager"
    sdpa = tiny_model("llama", 64, size=SIZE)
    with pytest.raises(RuntimeError), engine_attention(sdpa):
        assert sdpa.config._attn_implementation == NAME
        raise RuntimeError("a failing forward")
    assert sdpa.config._attn_implementation == "sdpa"
