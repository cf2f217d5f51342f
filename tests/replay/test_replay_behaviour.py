"""Engine behaviour besides exactness: skipping, OOM splitting, memory-aware logprobs, refusals, staleness."""

from __future__ import annotations

import pytest
import torch
from support.replay_cases import SHAPES, VOCAB, factory, make_batch
from torch.utils._python_dispatch import TorchDispatchMode

from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.models.presets import tiny_model
from treetrain.models.support import SupportGate, UnsupportedModelError, check_supported
from treetrain.replay import BackwardFailed, ReplayConfig, TreeReplay
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.replay.resident import ResidentIdentity, ResidentKey, ResidentStore, StaleResidentStateError
from treetrain.replay.verify import flat_grad, tree_gradient
from treetrain.tree.synthetic import synthetic_group


def _zero_adv_batch(loss: LossConfig):
    """Two of four branches share the group-mean reward, so their advantages are exactly zero."""
    tree = synthetic_group(
        prefix=20, branches=4, suffix=6, depth=1, vocab=VOCAB, rewards=[1.0, 0.5, 0.5, 0.0]
    )
    from treetrain.replay import UpdateBatch

    adv = compute_advantages([tree], AdvantageConfig(normalize_std=False))
    return UpdateBatch.build([tree], adv.trees, loss)


@pytest.mark.parametrize("loss", [LossConfig(), LossConfig(kl_coef=0.1), LossConfig(entropy_coef=0.01)])
def test_skipping_inert_branches_changes_nothing(loss: LossConfig) -> None:
    make = factory("llama", torch.float64)
    ref = factory("llama", torch.float64, seed=5) if loss.needs_reference else None
    batch = _zero_adv_batch(loss)
    skip = tree_gradient(make(), batch, loss, ReplayConfig(skip_inert=True), ref() if ref else None)
    keep = tree_gradient(make(), batch, loss, ReplayConfig(skip_inert=False), ref() if ref else None)
    assert torch.equal(skip, keep) or float((skip - keep).norm()) <= 1e-12 * float(keep.norm())
    report = TreeReplay(make(), loss, ReplayConfig(), ref_model=ref() if ref else None).accumulate(batch)
    # Only with no KL and no entropy are the zero-advantage branches inert, and only then skipped.
    assert report.skipped_units == (2 if loss.zero_advantage_is_inert else 0)


def test_simulated_oom_before_backward_splits_and_retries() -> None:
    loss = LossConfig()
    make = factory("llama", torch.float64)
    batch = make_batch(SHAPES["one_level"](0), loss)
    clean = tree_gradient(make(), batch, loss, ReplayConfig(microbatch=4))
    model = make()
    fired = []

    def hook(phase: str, step) -> None:
        if phase == "forward" and len(step.units) > 1 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("simulated")

    engine = TreeReplay(model, loss, ReplayConfig(microbatch=4), hooks=ReplayHooks(step=hook))
    model.zero_grad(set_to_none=True)
    report = engine.accumulate(batch)
    assert fired and report.oom_splits == 1
    assert float((flat_grad(model) - clean).norm()) <= 1e-12 * float(clean.norm())


def test_failure_during_backward_is_reported_not_retried() -> None:
    loss = LossConfig()
    model = factory("llama", torch.float64)()

    def broken_backward(t: torch.Tensor) -> None:
        raise RuntimeError("worker died")

    engine = TreeReplay(model, loss, ReplayConfig(), hooks=ReplayHooks(backward=broken_backward))
    with pytest.raises(BackwardFailed, match="window must be reset"):
        engine.accumulate(make_batch(SHAPES["one_level"](0), loss))


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_logprobs_never_materialize_full_logits() -> None:
    """A long response with a big vocabulary: no tensor reaches B x T x V elements."""
    vocab, resp = 4096, 256
    tree = synthetic_group(prefix=64, branches=2, suffix=resp, depth=1, vocab=vocab)
    loss = LossConfig(entropy_coef=0.01)
    model = tiny_model("llama", vocab, dtype=torch.float32)
    adv = compute_advantages([tree], AdvantageConfig())
    from treetrain.replay import UpdateBatch

    batch = UpdateBatch.build([tree], adv.trees, loss)
    budget = 64 * vocab
    engine = TreeReplay(model, loss, ReplayConfig(max_logit_elements=budget))
    with _LargestTensor() as probe:
        engine.accumulate(batch)
    assert probe.largest < 2 * resp * vocab, "full [B, T, V] logits were materialized"
    assert probe.largest <= max(budget, model.config.hidden_size * vocab)


def test_sliding_window_is_accepted_only_when_the_window_probe_agrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("mistral", VOCAB)
    assert model.config.sliding_window is not None
    check_supported(model, max_sequence_length=64)  # the mask drops the same keys split or whole
    import treetrain.models.continuation as continuation

    original = continuation.decoder_forward

    def window_lost_across_the_split(model, ids, pos, past, **kwargs):
        if past is None:
            return original(model, ids, pos, past, **kwargs)
        window, model.config.sliding_window = model.config.sliding_window, None
        try:
            return original(model, ids, pos, past, **kwargs)
        finally:
            model.config.sliding_window = window

    monkeypatch.setattr(continuation, "decoder_forward", window_lost_across_the_split)
    with pytest.raises(UnsupportedModelError, match="sliding window of 12"):
        check_supported(model, max_sequence_length=64)
    check_supported(model, max_sequence_length=12)  # no longer than the window: nothing to probe


def test_recurrent_and_dropout_models_are_refused() -> None:
    model = tiny_model("llama", VOCAB)
    model.config.model_type = "mamba"
    with pytest.raises(UnsupportedModelError, match="recurrent state"):
        check_supported(model, 32, probe=False)
    model = tiny_model("qwen2", VOCAB).train()
    model.config.attention_dropout = 0.1  # the layers keep the 0.0 they were built with: no dropout runs
    check_supported(model, 32, probe=False)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(UnsupportedModelError, match="dropout"):
        check_supported(model, 32, probe=False)


def test_probe_catches_a_cache_that_changes_results() -> None:
    """A model whose continuation from stored KV differs from a whole forward is refused by the probe."""
    model = tiny_model("llama", VOCAB)
    rope = model.model.rotary_emb
    original = rope.forward

    def shifted(x, position_ids):  # positions silently reset per call: continuation is wrong
        return original(x, position_ids - position_ids[:, :1])

    rope.forward = shifted
    with pytest.raises(UnsupportedModelError, match="continuing from stored KV"):
        check_supported(model, 32)


def test_stale_resident_state_is_refused() -> None:
    model = tiny_model("llama", VOCAB)
    identity = ResidentIdentity.of(model, version=3)
    store = ResidentStore(identity)
    key = ResidentKey("tree", 1, "node")
    kv = [(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))]
    store.put(key, kv, identity)
    assert store.kv_bytes == 2 * 64 * 4
    with pytest.raises(StaleResidentStateError, match="identity"):
        store.get(key, ResidentIdentity.of(model, version=3, tokenizer="other"))
    store.invalidate(identity.bumped())
    assert store.kv_bytes == 0
    with pytest.raises(StaleResidentStateError, match="invalidated by an optimizer step"):
        store.get(key, identity.bumped())
    with pytest.raises(StaleResidentStateError):
        store.get(key, identity)


def test_failure_after_backward_is_never_split_and_retried() -> None:
    """An out-of-memory error late in backward (G and parameter gradients partly accumulated) must not re-run
    the step's halves."""
    loss = LossConfig()
    model = factory("llama", torch.float64)()

    def backward_then_oom(total: torch.Tensor) -> None:
        total.backward()
        raise torch.OutOfMemoryError("simulated, at the end of backward")

    engine = TreeReplay(
        model, loss, ReplayConfig(microbatch=4), hooks=ReplayHooks(backward=backward_then_oom)
    )
    with pytest.raises(BackwardFailed, match="window must be reset"):
        engine.accumulate(make_batch(SHAPES["multi_level"](0), loss))


def test_skipping_under_kl_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: forcing the skip while a KL term is on changes the gradient, so the test above can fail."""
    loss = LossConfig(kl_coef=0.1)
    make, ref = factory("llama", torch.float64), factory("llama", torch.float64, seed=5)
    batch = _zero_adv_batch(loss)
    keep = tree_gradient(make(), batch, loss, ReplayConfig(skip_inert=False), ref())
    monkeypatch.setattr(LossConfig, "zero_advantage_is_inert", property(lambda self: True))
    skip = tree_gradient(make(), batch, loss, ReplayConfig(skip_inert=True), ref())
    assert float((skip - keep).norm()) > 1e-6 * float(keep.norm())


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused(rope_type: str) -> None:
    model = tiny_model("llama", VOCAB)
    extra = {"original_max_position_embeddings": 16, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    model.config.rope_parameters = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0, **extra}
    with pytest.raises(UnsupportedModelError, match=f"rope_type '{rope_type}'"):
        check_supported(model, 32, probe=False)


def test_logits_changed_after_the_head_are_applied_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Granite divides its logits by `logits_scaling` after the LM head, and the engine's head does too; a
    head that got the transform wrong (here: multiplying, as for HyperCLOVA X) is refused."""
    from transformers import GraniteConfig, GraniteForCausalLM

    import treetrain.models.logit_head as logit_head

    config = GraniteConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, logits_scaling=8.0,
    )  # fmt: skip
    check_supported(GraniteForCausalLM(config), 32)
    monkeypatch.setattr(logit_head, "MULTIPLIED_LOGITS_SCALING", frozenset({"granite"}))
    with pytest.raises(UnsupportedModelError, match="changes its logits after the LM head"):
        check_supported(GraniteForCausalLM(config), 32)
    config.logits_scaling = 1.0
    check_supported(GraniteForCausalLM(config), 32)


def test_support_gate_rechecks_longer_batches_and_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    import treetrain.models.support as support

    model = tiny_model("mistral", VOCAB)
    probes: list[int] = []
    original = support.probe_split
    monkeypatch.setattr(
        support, "probe_split", lambda m, t, **kw: probes.append(kw.get("length", 12)) or original(m, t, **kw)
    )
    gate = SupportGate()
    gate.require(model, 8)
    gate.require(model, 12)
    assert probes == [12]  # the general probe once; the window (12) is not exceeded yet
    gate.require(model, 30)
    gate.require(model, 40)
    assert probes == [12, 26]  # the window probe once, when sequences first run past the window
    # The engine checks the reference model as well as the policy.
    loss = LossConfig(kl_coef=0.1)
    batch = _zero_adv_batch(loss)
    ref = tiny_model("llama", VOCAB, dtype=torch.float64)
    ref.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    engine = TreeReplay(factory("llama", torch.float64)(), loss, ReplayConfig(), ref_model=ref)
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'"):
        engine.accumulate(batch)


def test_out_of_memory_in_a_scoring_batch_splits_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scoring forward of several siblings that runs out of memory is retried in halves, same result."""
    import treetrain.replay.scoring as scoring

    loss = LossConfig()
    batch = _zero_adv_batch(loss)
    make = factory("llama", torch.float64)
    cfg = ReplayConfig(skip_inert=False)
    expected = tree_gradient(make(), batch, loss, cfg)
    original, widths = scoring._score_batch, []

    def only_single_rows(model, paths, parent, units, **kwargs):
        widths.append(len(units))
        if len(units) > 1:
            raise torch.OutOfMemoryError("simulated: scoring batch too wide")
        return original(model, paths, parent, units, **kwargs)

    monkeypatch.setattr(scoring, "_score_batch", only_single_rows)
    got = tree_gradient(make(), batch, loss, cfg)
    assert max(widths) > 1 and widths.count(1) >= 4
    assert float((got - expected).norm()) <= 1e-12 * float(expected.norm())
