"""The `hf` engine's shared pieces (`treetrain.rollout.engines.cascade`) against every row holding its own
KV: a common system prompt encoded once, a fork's context read once by its rows, kept prefixes that continue
a piece. The samples must be the same to float64 rounding, and a corrupted piece must show."""

from __future__ import annotations

import pytest
import torch
from support.engine_runs import run_requests
from support.env_fixtures import tiny_model, tokenizer
from transformers import Gemma2Config, Gemma2ForCausalLM

from treetrain.rollout.engines.cascade import Piece, cascade_reason, cascade_runs, groups_of
from treetrain.rollout.engines.generation import GenerationRequest, GenerationResult
from treetrain.rollout.engines.hf_encoder import MIN_PIECE
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.rollout.sampling import Sampling

torch.set_num_threads(1)
SHARP = tiny_model(init=0.5)  # float64, peaked: a wrong piece or mask visibly changes the tokens
END = ((tokenizer().convert_tokens_to_ids("<|im_end|>"),),)
HOT, GREEDY = Sampling(temperature=1.0), Sampling(temperature=0.0)
SYSTEM = "You are a careful assistant. Answer with one number, show no work, and never guess at all."
QUESTIONS = [
    "What is 2 + 2?",
    "A train leaves at noon going sixty miles an hour and another one leaves an hour later going ninety "
    "miles an hour on the same track in the same direction; when does the second one catch the first?",
    "What is 7 * 6?",
]


def _contexts() -> list[tuple[int, ...]]:
    def chat(q: str) -> str:
        return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"

    return [tuple(tokenizer().encode(chat(q))) for q in QUESTIONS]


def _requests(sampling: Sampling, n: int = 4) -> list[GenerationRequest]:
    return [
        GenerationRequest(c, n, 12, sampling, END, seed=s, group=f"g{s}", children=1)
        for s, c in enumerate(_contexts())
    ]


def _same(a: dict[int, GenerationResult], b: dict[int, GenerationResult], tol: float = 1e-9) -> None:
    for i in a:
        for x, y in zip(a[i].completions, b[i].completions, strict=True):
            assert x.tokens == y.tokens and x.finish == y.finish
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < tol


def test_the_contexts_exercise_every_piece() -> None:
    contexts = _contexts()
    common = next(i for i in range(len(contexts[0])) if len({c[i] for c in contexts}) > 1)
    assert common > MIN_PIECE  # the system prompt is shared as a piece
    assert (
        len(contexts[1]) - common > MIN_PIECE > len(contexts[0]) - common
    )  # one fork has a piece of its own


@pytest.mark.parametrize("sampling", [GREEDY, HOT])
def test_shared_pieces_sample_what_rows_of_their_own_kv_sample(sampling: Sampling) -> None:
    shared = HFEngine(SHARP)
    assert shared.cascade
    got = run_requests(shared, _requests(sampling))
    own = HFEngine(SHARP, share_contexts=False)
    assert not own.cascade
    want = run_requests(own, _requests(sampling))
    _same(got, want)
    kept = list(shared._kept.values())
    pieces = {id(p): p for e in kept for p in e.chain}
    assert len(pieces) == 2  # the common system prompt, and the long question's own context
    piece_bytes = sum(t.numel() * t.element_size() for p in pieces.values() for kv in p.layers for t in kv)
    assert shared.held_bytes == sum(e.nbytes for e in kept) + piece_bytes  # a piece counts once
    assert shared.held_bytes < own.held_bytes  # `own` keeps a copy of the context per sample
    prompt = sum(len(c) for c in _contexts())
    assert (
        shared.stats.encoded_tokens - shared.stats.sampled_tokens
        < own.stats.encoded_tokens - own.stats.sampled_tokens
    )
    assert own.stats.encoded_tokens - own.stats.sampled_tokens < prompt + len(_requests(sampling)) * 4


def test_a_next_turn_continues_the_pieces_of_its_kept_prefix() -> None:
    observation = tuple(
        tokenizer().encode("<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n")
    )
    results = {}
    for share in (True, False):
        engine = HFEngine(SHARP, share_contexts=share)
        first = run_requests(engine, _requests(HOT))
        follow = [
            GenerationRequest(c + first[i].completions[j].tokens + observation, 2, 10, HOT, END, seed=10 + i)
            for i, c in enumerate(_contexts())
            for j in range(2)
        ]
        results[share] = run_requests(engine, follow)
        contexts = [c for c in _contexts() for _ in range(2)]
        assert all(r.cached_tokens >= len(c) for r, c in zip(results[share].values(), contexts, strict=True))
    _same(results[True], results[False])


def test_a_corrupted_piece_changes_the_samples() -> None:
    """Negative control: the pieces are read, so perturbing the common one moves the next turn."""
    observation = tuple(
        tokenizer().encode("<|im_end|>\n<|im_start|>user\nwhy?<|im_end|>\n<|im_start|>assistant\n")
    )
    outs = []
    for corrupt in (False, True):
        engine = HFEngine(SHARP)
        first = run_requests(engine, _requests(GREEDY, n=2))
        if corrupt:
            for entry in engine._kept.values():
                k, _ = entry.chain[0].layers[0]
                k.mul_(-1.0)
        follow = [GenerationRequest(c + first[i].completions[0].tokens + observation, 1, 10, GREEDY, END)
                  for i, c in enumerate(_contexts())]  # fmt: skip
        outs.append(run_requests(engine, follow))
    assert any(outs[0][i].completions != outs[1][i].completions for i in outs[0])


def test_rows_are_grouped_by_the_pieces_they_share() -> None:
    a, b, c, d = (Piece(()) for _ in range(4))
    names = {id(a): "a", id(b): "b", id(c): "c", id(d): "d"}
    runs = [(s, e, names[id(p)]) for s, e, p in groups_of([(a, b), (a, b), (a, c), (a,), (), (d,), (d,)])]
    assert sorted(runs) == [(0, 2, "b"), (0, 4, "a"), (2, 3, "c"), (5, 7, "d")]


def test_a_model_whose_attention_has_more_terms_keeps_its_own_kv() -> None:
    """Gemma 2 caps its attention scores: no shared pieces, and the engine still samples."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=len(tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4096,
        attn_logit_softcapping=50.0, layer_types=["full_attention", "full_attention"],
    )  # fmt: skip
    model = Gemma2ForCausalLM(config).eval()
    assert cascade_reason(model) is not None
    engine = HFEngine(model)
    assert not engine.cascade
    assert len(run_requests(engine, _requests(HOT, n=2))) == 3
    assert cascade_reason(SHARP) is None and cascade_runs(SHARP)


class _Layer(torch.nn.Module):
    """What cascade attention reads of a layer: its index."""

    layer_idx = 0


def _layer_case(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Queries of 5 rows (4 heads over 2 KV heads, 3 new tokens each) over padded own keys and two pieces,
    the first shared by rows 0-3, the second by rows 1-2."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q, k, v = rand(5, 4, 3, 8), rand(5, 2, 7, 8), rand(5, 2, 7, 8)  # own cache: 4 kept columns + 3 new
    visible = torch.ones(5, 3, 7, dtype=torch.bool)
    visible[:, :, 4:] = torch.ones(3, 3, dtype=torch.bool).tril()  # the new tokens are causal
    visible[3, :, :2] = False  # row 3 has two columns of padding
    visible[4, :, :4] = False  # row 4 has no kept own tokens
    return q, k, v, visible, rand(1, 2, 6, 8), rand(1, 2, 6, 8), rand(1, 2, 5, 8), rand(1, 2, 5, 8)


def _reference(q, k, v, visible, pk1, pv1, pk2, pv2, scale):  # type: ignore[no-untyped-def]
    """Plain SDPA per row over its pieces and own keys, concatenated (float64)."""
    out = []
    for r in range(q.shape[0]):
        keys, values = [k[r : r + 1]], [v[r : r + 1]]
        vis = [visible[r]]
        for rows, pk, pv in ((range(4), pk1, pv1), (range(1, 3), pk2, pv2)):
            if r in rows:
                keys.insert(0, pk)
                values.insert(0, pv)
                vis.insert(0, torch.ones(3, pk.shape[2], dtype=torch.bool))
        kk, vv = torch.cat(keys, 2).double(), torch.cat(values, 2).double()
        mask = torch.cat(vis, 1)[None, None]  # [1, 1, T, L]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[r : r + 1].double(), kk, vv, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out.append(o.transpose(1, 2))
    return torch.cat(out)  # [R, T, H, D]


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 3e-2)]
)
def test_cascade_attention_is_attention_over_the_concatenated_keys(dtype: torch.dtype, tol: float) -> None:
    from treetrain.rollout.engines.cascade import _ACTIVE, Layout, cascade_forward

    q, k, v, visible, pk1, pv1, pk2, pv2 = _layer_case(dtype)
    first, second = Piece(((pk1, pv1),)), Piece(((pk2, pv2),))
    layout = Layout(groups_of([(first,), (first, second), (first, second), (first,), ()]), visible)
    want = _reference(q, k, v, visible, pk1, pv1, pk2, pv2, 0.3)
    token = _ACTIVE.set(layout)
    try:
        got, _ = cascade_forward(_Layer(), q, k, v, None, scaling=0.3)
        control = Layout(groups_of([(first,), (first,), (first,), (first,), ()]), visible)  # a piece skipped
        _ACTIVE.set(control)
        skipped, _ = cascade_forward(_Layer(), q, k, v, None, scaling=0.3)
    finally:
        _ACTIVE.reset(token)
    assert got.dtype == dtype and got.shape == (5, 3, 4, 8)
    err = float((got.double() - want).abs().max())
    assert err < tol
    assert float((skipped.double() - want).abs().max()) > 10 * tol  # negative control: a piece left out
