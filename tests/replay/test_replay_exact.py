"""`exact` tree replay equals the flat reference within the flat path's own noise floor.

The floor is measured per case (`noise_floor`): two valid flat runs, another summation order and a
one-float32-ulp parameter move, disagree by that much. The tolerance is FACTOR times the floor. The negative
controls show the same check rejects a detached (`response_only`) gradient and a one-trajectory bookkeeping
error, so it is not vacuous.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from support.replay_cases import SHAPES, factory, make_batch

from treetrain.loss.loss_config import LossConfig
from treetrain.models.presets import ATTENTION, EAGER_ONLY, FAMILIES, MORE_FAMILIES
from treetrain.replay import ReplayConfig, UpdateBatch
from treetrain.replay.flat_reference import ONE_CALL
from treetrain.replay.verify import deviation, flat_gradient, noise_floor, tree_gradient

FACTOR = 5.0
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _check(
    family: str, dtype: torch.dtype, shape: str, loss: LossConfig, replay: ReplayConfig, attn: str = "sdpa"
):
    make = factory(family, dtype, attn)
    make_ref = factory(family, dtype, attn, seed=7) if loss.needs_reference else None
    batch = make_batch(SHAPES[shape](0), loss)
    floor = noise_floor(make, batch, loss, make_ref)
    ref = make_ref() if make_ref else None
    flat = flat_gradient(make(), batch, loss, ref)
    tree = tree_gradient(make(), batch, loss, replay, make_ref() if make_ref else None)
    dev = deviation(tree, flat)
    assert float(flat.norm()) > 0, "the case produced no gradient at all"
    return dev, floor


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_matches_flat_every_family(family: str, attn: str, dtype: str) -> None:
    dev, floor = _check(family, DTYPES[dtype], "multi_level", LossConfig(), ReplayConfig(microbatch=2), attn)
    assert dev.abs <= FACTOR * floor, (
        f"{family}/{attn}/{dtype}: |exact - flat| = {dev.abs:.3e} > {FACTOR} x {floor:.3e}"
    )


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_exact_matches_flat_every_shape(shape: str, dtype: str) -> None:
    # The entropy term keeps a gradient where GRPO advantages vanish (a single trajectory).
    dev, floor = _check("llama", DTYPES[dtype], shape, LossConfig(entropy_coef=0.01), ReplayConfig())
    assert dev.abs <= FACTOR * floor, f"{shape}/{dtype}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize(
    "loss",
    [
        LossConfig(aggregation="seq-mean-token-mean", kl_coef=0.2, kl_estimator="k1"),
        LossConfig(aggregation="seq-mean-token-sum", seq_sum_normalizer=8.0, kl_coef=0.1, entropy_coef=0.05),
        LossConfig(ratio_source="sampler", clip_low=0.1, clip_high=0.3, dual_clip=3.0),
    ],
    ids=["seq-mean-token-mean+k1", "dr-grpo+k3+entropy", "sampler-ratio+clipping"],
)
def test_exact_matches_flat_every_loss(loss: LossConfig) -> None:
    dev, floor = _check("qwen3", torch.float64, "multi_level", loss, ReplayConfig(microbatch=2))
    assert dev.abs <= FACTOR * floor, f"{loss}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


def test_sampler_ratio_case_really_clips() -> None:
    """The sampler-ratio case above is only meaningful if ratios leave the clip range."""
    loss = LossConfig(ratio_source="sampler", clip_low=0.1, clip_high=0.3)
    make = factory("qwen3", torch.float64)
    from treetrain.replay import FlatReference

    report = FlatReference(make(), loss).accumulate(make_batch(SHAPES["multi_level"](0), loss))
    assert report.clipped > 0.05


@pytest.mark.parametrize(
    "replay",
    [
        ReplayConfig(microbatch=1, order="tree"),
        ReplayConfig(microbatch=1, order="reverse"),
        ReplayConfig(microbatch=2, order="shuffle", seed=3),
        ReplayConfig(microbatch=0, order="shuffle", seed=4),
        ReplayConfig(microbatch=1, chunk_size=1),
        ReplayConfig(microbatch=2, chunk_size=3, order="reverse"),
        ReplayConfig(microbatch=0, chunk_size=7, score_microbatch=1),
    ],
    ids=lambda r: f"K{r.microbatch}-{r.order}-chunk{r.chunk_size}",
)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_exact_invariant_to_order_k_and_chunking(replay: ReplayConfig, dtype: str) -> None:
    loss = LossConfig(kl_coef=0.05, entropy_coef=0.01)
    dev, floor = _check("llama", DTYPES[dtype], "two_trees", loss, replay)
    assert dev.abs <= FACTOR * floor, f"{replay}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


def _adamw_delta(model: torch.nn.Module, grad_fn) -> torch.Tensor:
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    grad_fn(model)
    opt.step()
    return torch.cat([(p.detach() - b).reshape(-1).double() for p, b in zip(model.parameters(), before)])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_adamw_parameter_delta_matches_flat(dtype: str) -> None:
    """One AdamW step from the tree gradient moves the parameters as the flat gradient does."""
    loss = LossConfig()
    make = factory("qwen2", DTYPES[dtype])
    batch = make_batch(SHAPES["multi_level"](0), loss)

    def flat(m, replay=ONE_CALL):
        return flat_gradient(m, batch, loss, None, replay)

    d_flat = _adamw_delta(make(), flat)
    d_reorder = _adamw_delta(make(), lambda m: flat(m, ReplayConfig(order="reverse", microbatch=3)))
    d_tree = _adamw_delta(
        make(), lambda m: tree_gradient(m, batch, loss, ReplayConfig(microbatch=1, chunk_size=4))
    )
    # AdamW's first step is lr * g / (|g| + eps): near-zero gradient entries amplify noise, so the floor is
    # measured on the deltas themselves, with the same two flat variants as for gradients.
    moved = make()
    from treetrain.replay.verify import _perturb

    _perturb(moved, seed=99)
    start = torch.cat([p.detach().reshape(-1).double() for p in moved.parameters()])
    base = torch.cat([p.detach().reshape(-1).double() for p in make().parameters()])
    d_moved = _adamw_delta(moved, flat) + (start - base)
    floor = max(float((d_flat - d_reorder).norm()), float((d_flat - d_moved).norm()))
    err = float((d_tree - d_flat).norm())
    assert float(d_flat.norm()) > 1e-4
    assert err <= FACTOR * floor, f"delta mismatch {err:.3e} > {FACTOR} x {floor:.3e}"


def test_negative_control_detached_gradient_is_rejected() -> None:
    """response_only drops prefix-side gradient; the exactness check must notice."""
    dev, floor = _check(
        "llama", torch.float64, "multi_level", LossConfig(), ReplayConfig(contract="response_only")
    )
    assert dev.abs > 1000 * FACTOR * floor


def test_negative_control_bookkeeping_error_is_rejected() -> None:
    """Doubling one trajectory's coefficient in one node is far above the floor."""
    loss = LossConfig()
    make = factory("llama", torch.float64)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    floor = noise_floor(make, batch, loss)
    flat = flat_gradient(make(), batch, loss)
    work = batch.work[0]
    victim = next(i for i, t in enumerate(work.targets) if t.num_targets)
    table = work.targets[victim]
    coef = np.array(table.coef)
    coef[0] *= 2
    tables = list(work.targets)
    tables[victim] = dataclasses.replace(table, coef=coef)
    broken = UpdateBatch((dataclasses.replace(work, targets=tuple(tables)),), batch.manifest)
    tree = tree_gradient(make(), broken, loss, ReplayConfig())
    assert deviation(tree, flat).abs > 100 * FACTOR * floor


def test_exact_matches_flat_to_float64_precision_without_float32_islands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With RMSNorm kept in float64 (HF upcasts to float32), the only noise left is summation order.

    The floor used elsewhere includes a one-float32-ulp parameter move because HF models round through
    float32 inside every norm. Removing that island shows the engine itself is exact to ~1e-15.
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def rms_norm_f64(self: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", rms_norm_f64)
    loss = LossConfig()
    make = factory("llama", torch.float64)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    flat = flat_gradient(make(), batch, loss)
    reordered = flat_gradient(make(), batch, loss, replay=ReplayConfig(order="reverse", microbatch=2))
    floor = max(float((flat - reordered).norm()), 4 * torch.finfo(torch.float64).eps * float(flat.norm()))
    tree = tree_gradient(make(), batch, loss, ReplayConfig(microbatch=2, chunk_size=5))
    dev = deviation(tree, flat)
    assert dev.abs <= FACTOR * floor, f"|exact - flat| = {dev.abs:.3e} > {FACTOR} x {floor:.3e}"
    assert dev.rel < 1e-13


def _more_family(family: str) -> str:
    return "eager" if family in EAGER_ONLY else "sdpa"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_exact_matches_flat_more_families(family: str, dtype: str) -> None:
    """MLA (DeepSeek V3), logit scaling (Granite, Cohere), soft-capping (Gemma 2), `.h` blocks (GPT-2) and
    cross-layer KV sharing (Gemma 4), through a tree of several levels with chunks and K = 2."""
    replay = ReplayConfig(microbatch=2, chunk_size=5)
    dev, floor = _check(family, DTYPES[dtype], "multi_level", LossConfig(), replay, _more_family(family))
    assert dev.abs <= FACTOR * floor, (
        f"{family}/{dtype}: |exact - flat| = {dev.abs:.3e} > {FACTOR} x {floor:.3e}"
    )


def test_negative_control_mla_latent_gradient_left_out_of_g_is_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MLA's resident pieces are latents, expanded per piece: expanding detached latents, so that their
    gradient never reaches G, is caught far above the bound."""
    import treetrain.models.attention as attention

    def detached(expand, past, grads, anchor):  # type: ignore[no-untyped-def]
        return tuple(expand(k.detach(), v.detach()) for k, v in past), (None,) * len(past)

    monkeypatch.setattr(attention, "expanded_past", detached)
    dev, floor = _check("deepseek_v3", torch.float64, "multi_level", LossConfig(), ReplayConfig(microbatch=2))
    assert dev.abs > 100 * FACTOR * floor, f"{dev.abs:.3e} not far above {FACTOR} x {floor:.3e}"


def test_negative_control_kv_sharing_gradient_left_out_of_g_is_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gemma 4's reusing layers attend over the source layer's resident pieces: leaving their share of the
    pieces' gradient out of G (the source layers' own share stays) is caught far above the bound."""
    import treetrain.models.attention as attention

    source, attend = attention.kv_source_layer, attention.shared_attention
    reusing: list[bool] = []

    def spy(module):  # type: ignore[no-untyped-def]
        reusing.append(bool(getattr(module, "is_kv_shared_layer", False)))
        return source(module)

    def detached(q, k, v, positions, past, grads, form, **kw):  # type: ignore[no-untyped-def]
        if reusing[-1]:
            past, grads = tuple((a.detach(), b.detach()) for a, b in past), (None,) * len(past)
        return attend(q, k, v, positions, past, grads, form, **kw)

    monkeypatch.setattr(attention, "kv_source_layer", spy)
    monkeypatch.setattr(attention, "shared_attention", detached)
    dev, floor = _check("gemma4_text", torch.float64, "multi_level", LossConfig(), ReplayConfig(microbatch=2))
    assert any(reusing) and not all(reusing), "the case ran no reusing layer, or only reusing ones"
    assert dev.abs > 100 * FACTOR * floor, f"{dev.abs:.3e} not far above {FACTOR} x {floor:.3e}"
