"""LoRA adapters (PEFT): config, frozen base, the reference with adapters off, and exact replay against flat.

The differential cases follow tests/replay/test_replay_exact.py: the gradient of `exact` tree replay must equal the
flat run of the same PEFT model within FACTOR times the measured noise floor. With KL the reference is the
same model with its adapters disabled; the negative control leaves them on and must be caught.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from support.lora_cases import OTHER_FAMILY, base_model, lora_factory, trained_like
from support.replay_cases import SHAPES, VOCAB, make_batch

from treetrain.distributed import TorchBackend
from treetrain.errors import ConfigError
from treetrain.loss.loss_config import LossConfig
from treetrain.models.lora import (
    AdaptersOff,
    LoraSection,
    adapter_state,
    adapters_disabled,
    apply_lora,
    is_adapter_param,
    peft_quiet,
)
from treetrain.models.presets import FAMILIES
from treetrain.replay import FlatReference, ReplayConfig, TreeReplay
from treetrain.replay.resident import ResidentIdentity, ResidentKey, ResidentStore, StaleResidentStateError
from treetrain.replay.scoring import LogitSettings, PathKV, scoring_pass
from treetrain.replay.units import UnitTree
from treetrain.replay.verify import deviation, flat_grad, flat_gradient, noise_floor
from treetrain.train.config import load_config

if TYPE_CHECKING:
    from treetrain.train.loop import Trainer

FACTOR = 5.0
DTYPES = {"float64": torch.float64, "float32": torch.float32}
KL = LossConfig(kl_coef=0.2, kl_estimator="k3")


# ----- config ------------------------------------------------------------------------------------------
def test_config_section_is_typed_and_off_by_default() -> None:
    assert load_config(None).model.lora is None
    cfg = load_config(None, ["model.lora.r=8", "model.lora.target_modules=[q_proj, v_proj]"])
    assert cfg.model.lora == LoraSection(r=8, target_modules=("q_proj", "v_proj"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.dropout=0.1", "model.lora.dropout: must be 0, got 0.1: dropout draws a new mask"),
        ("model.lora.r=0", "model.lora.r: must be in [1, 16384], got 0"),
        ("model.lora.init=corda", "model.lora.init: must be one of"),
        ("model.lora.init=loftq", "model.lora.init: 'loftq' initializes adapters against a quantized base"),
        (
            "model.lora.init=pissa\nmodel.lora.modules_to_save=[lm_head]",
            "model.lora.init: 'pissa' keeps a frozen",
        ),
        (
            "model.lora.init=olora\nmodel.dtype=float64",
            "model.lora.init: PEFT's 'olora' decomposition runs in",
        ),
        ("model.lora.target_modules=[]", "model.lora.target_modules: name at least one"),
        ("model.lora.adapter=/nonexistent", "model.lora.adapter: '/nonexistent' is not a PEFT adapter"),
        ("model.reference=base", "model.reference: 'base' (the policy with adapters off) needs model.lora"),
    ],
)
def test_config_refuses_bad_values_before_loading(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, override.split("\n"))


def test_kl_with_lora_names_the_free_reference() -> None:
    with pytest.raises(ConfigError, match="'base'"):
        load_config(None, ["model.lora.r=4", "loss.kl_coef=0.1"])
    cfg = load_config(None, ["model.lora.r=4", "loss.kl_coef=0.1", "model.reference=base"])
    assert cfg.model.reference == "base"


def test_adapter_directory_round_trip_and_dropout_forced_to_zero(tmp_path, caplog) -> None:
    policy = lora_factory("llama", torch.float32)()
    policy.save_pretrained(tmp_path)
    cfg_file = tmp_path / "adapter_config.json"
    saved = json.loads(cfg_file.read_text())
    saved["lora_dropout"] = 0.05
    cfg_file.write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=re.escape("model.lora.r: the adapter in")):
        LoraSection(r=16, adapter=str(tmp_path))
    loaded = apply_lora(base_model("llama", torch.float32), LoraSection(adapter=str(tmp_path)))
    assert "set to 0" in caplog.text
    assert all(m.p == 0 for m in loaded.modules() if isinstance(m, torch.nn.Dropout))
    want = {n: p for n, p in policy.named_parameters() if is_adapter_param(n)}
    got = {n: p for n, p in loaded.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_a_hostile_or_foreign_adapter_is_a_config_error(tmp_path) -> None:
    """A non-numeric dropout, a deeply nested config and another base model's adapter each end in one
    ConfigError, never a traceback or a silently fresh adapter."""
    policy = lora_factory("llama", torch.float32)()
    policy.save_pretrained(tmp_path)
    cfg_file = tmp_path / "adapter_config.json"
    saved = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**saved, "lora_dropout": "abc"}))
    with pytest.raises(ConfigError, match="lora_dropout must be a number"):
        LoraSection(adapter=str(tmp_path))
    cfg_file.write_text('{"peft_type": "LORA", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LoraSection(adapter=str(tmp_path))
    cfg_file.write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match="trained on another base model"):
        apply_lora(base_model(OTHER_FAMILY, torch.float32), LoraSection(adapter=str(tmp_path)))


# ----- frozen base, resident identity ------------------------------------------------------------------
@pytest.mark.parametrize("contract", ["exact", "response_only"])
def test_only_adapter_parameters_get_gradients(contract: str) -> None:
    model = lora_factory("qwen3", torch.float32, modules_to_save=("lm_head",))()
    loss = LossConfig(kl_coef=0.1)
    TreeReplay(
        model, loss, ReplayConfig(contract=contract, microbatch=2), ref_model=AdaptersOff(model)
    ).accumulate(make_batch(SHAPES["multi_level"](0), loss))
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert with_grad == trainable and any(".modules_to_save." in n for n in trainable)
    assert all(is_adapter_param(n) for n in trainable)
    assert all(float(model.get_parameter(n).grad.norm()) > 0 for n in with_grad if ".lora_" in n)


def test_identity_tells_adapters_on_from_off() -> None:
    model = lora_factory("llama", torch.float32)()
    on = ResidentIdentity.of(model)
    with model.disable_adapter():
        off = ResidentIdentity.of(model)
        assert adapter_state(model) == "off"
    assert (on.adapters, off.adapters) == ("on", "off")
    assert ResidentIdentity.of(base_model("llama", torch.float32)).adapters == "none"


@pytest.mark.parametrize("written", ["off", "on"])
def test_stale_state_adapters_off_never_read_as_policy(written: str) -> None:
    """KV scored with adapters off is refused when read as policy KV, and the other way round."""
    model = lora_factory("llama", torch.float32)()
    units = UnitTree.build(
        SHAPES["one_level"](0)[0], make_batch(SHAPES["one_level"](0), LossConfig()).work[0].targets
    )
    on = ResidentIdentity.of(model)
    with model.disable_adapter():
        off = ResidentIdentity.of(model)
    write, read = (off, on) if written == "off" else (on, off)
    store = ResidentStore(write)
    paths = PathKV(model, units, store, write, torch.device("cpu"))
    need = [True] * len(units)
    with model.disable_adapter() if written == "off" else torch.no_grad():
        scoring_pass(paths, microbatch=0, need=need, keep=lambda u: True, logits=LogitSettings(1 << 20))
    key = ResidentKey(units.tree.id, 1, units.tree.nodes[units[1].node].id)
    assert store.has_kv(key, write)
    with pytest.raises(StaleResidentStateError):
        store.get(key, read)
    with pytest.raises(StaleResidentStateError):
        PathKV(model, units, store, read, torch.device("cpu")).pieces(1)


def test_adapters_off_refuses_a_model_without_adapters() -> None:
    with pytest.raises(TypeError, match="KL term would be zero"):
        AdaptersOff(base_model("llama", torch.float32))


# ----- exact against flat ------------------------------------------------------------------------------
def _deviation(
    family: str, dtype: torch.dtype, loss: LossConfig, wrong_reference: bool = False, walk: str = "fused"
):
    make = lora_factory(family, dtype)
    batch = make_batch(SHAPES["multi_level"](0), loss)
    kl = loss.needs_reference
    floor = noise_floor(make, batch, loss, adapters_off_reference=kl)
    flat_model = make()
    flat = flat_gradient(flat_model, batch, loss, AdaptersOff(flat_model) if kl else None)
    tree_model = make()
    ref = (tree_model if wrong_reference else AdaptersOff(tree_model)) if kl else None
    replay = ReplayConfig(microbatch=2, chunk_size=5, reference_walk=walk)  # type: ignore[arg-type]
    report = TreeReplay(tree_model, loss, replay, ref_model=ref).accumulate(batch)
    walks = 0 if not kl or (walk == "fused" and not wrong_reference) else len(batch.work)
    assert report.reference_walks == walks  # the reference took the walk asked for
    assert float(flat.norm()) > 0
    return deviation(flat_grad(tree_model), flat), floor


@pytest.mark.parametrize("kl", [False, True], ids=["no-kl", "kl-adapters-off"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", [*FAMILIES, OTHER_FAMILY])
def test_lora_exact_matches_flat(family: str, dtype: str, kl: bool) -> None:
    """With KL the reference (adapters off) is scored in the policy's scoring walk, in one tree walk."""
    dev, floor = _deviation(family, DTYPES[dtype], KL if kl else LossConfig())
    assert dev.abs <= FACTOR * floor, f"{family}/{dtype}/kl={kl}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lora_separate_reference_walk_matches_flat(dtype: str) -> None:
    """The planner's fallback, the reference in a second walk, gives the same update."""
    dev, floor = _deviation("qwen3", DTYPES[dtype], KL, walk="separate")
    assert dev.abs <= FACTOR * floor, f"{dtype}: {dev.abs:.3e} > {FACTOR} x {floor:.3e}"


def test_negative_control_reference_with_adapters_on_is_caught() -> None:
    """Passing the policy itself (adapters on) as the reference makes KL vanish; the check must notice."""
    dev, floor = _deviation("llama", torch.float64, KL, wrong_reference=True)
    assert dev.abs > 100 * FACTOR * floor


def test_negative_control_fused_walk_with_adapters_left_on_is_caught(monkeypatch) -> None:
    """The fused walk's reference forward run with the adapters left on (its identity then says 'on' too)
    is caught by the differential check, like the reference passed as the policy itself."""
    import contextlib

    import treetrain.replay.reference as reference_mod

    monkeypatch.setattr(reference_mod, "adapters_disabled", lambda ref: contextlib.nullcontext(ref.model))
    dev, floor = _deviation("llama", torch.float64, KL)
    assert dev.abs > 100 * FACTOR * floor


def test_fused_walk_refuses_a_reference_forward_with_adapters_on() -> None:
    """KV scored with the adapters on is never stored as the reference's (identity adapters 'off')."""
    import contextlib

    from treetrain.replay.scoring import ReferenceWalk

    model = lora_factory("llama", torch.float32)()
    units = UnitTree.build(
        SHAPES["one_level"](0)[0], make_batch(SHAPES["one_level"](0), LossConfig()).work[0].targets
    )
    on = ResidentIdentity.of(model)
    with model.disable_adapter():
        off = ResidentIdentity.of(model)
    cpu = torch.device("cpu")
    walk = ReferenceWalk(PathKV(model, units, ResidentStore(off), off, cpu), enter=contextlib.nullcontext)
    with pytest.raises(
        StaleResidentStateError, match="adapters 'on' into a store of identity adapters='off'"
    ):
        scoring_pass(
            PathKV(model, units, ResidentStore(on), on, cpu), microbatch=0, need=[True] * len(units),
            keep=lambda u: True, logits=LogitSettings(1 << 20), reference=walk,
        )  # fmt: skip


def test_flat_reference_pass_restores_adapters() -> None:
    model = trained_like(apply_lora(base_model("qwen2", torch.float32), LoraSection(r=2)))
    FlatReference(model, KL, ref_model=AdaptersOff(model)).accumulate(make_batch(SHAPES["single"](0), KL))
    assert adapter_state(model) == "on"
    assert model.config.vocab_size == VOCAB


# ----- the trainer ----------------------------------------------------------------------------------
@pytest.mark.launch  # end-to-end runs: each starts its environment worker processes
def test_trainer_resume_with_adapters_equals_straight_run_and_exports(tmp_path) -> None:
    """KL against adapters off (0 on the first update, > 0 after); resume reproduces the uninterrupted run;
    final/ is the adapter, final-merged/ a plain model giving the adapted policy's logits."""
    from safetensors.torch import load_file
    from support.train_cases import TINY

    from treetrain.train.loop import Trainer
    from treetrain.train.metrics import read_metrics

    sets = [*TINY, "measure_memory_every=0", "model.lora.r=4", "loss.kl_coef=0.05", "model.reference=base"]

    def cfg(name: str, updates: int, *extra: str):
        return load_config(None, [*sets, f"run_dir={tmp_path / name}", f"updates={updates}", *extra])

    straight = Trainer(cfg("a", 2, "model.lora.export_merged=true"), progress=False)
    straight.run()
    Trainer(cfg("b", 1), progress=False).run()
    Trainer(cfg("b", 2), resume=True, progress=False).run()
    a, b = (read_metrics(tmp_path / n / "metrics.jsonl") for n in "ab")
    assert a[0].kl == 0.0 and a[1].kl > 0 and a[1].loss == pytest.approx(b[1].loss, rel=1e-6, abs=1e-9)
    wa, wb = (load_file(tmp_path / n / "final" / "adapter_model.safetensors") for n in "ab")
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], rtol=1e-6, atol=1e-7) for k in wa)
    _assert_merged_export_is_the_policy(straight, tmp_path / "a" / "final-merged")


def _assert_merged_export_is_the_policy(trainer: Trainer, merged_dir: Path) -> None:
    """The merged Hugging Face export gives the trained policy's logits."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        want = trainer.backend.module(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)


# ----- PiSSA / OLoRA: inits that rewrite the base ---------------------------------------------------------
def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]  # [1, T-1, V]
    return torch.log_softmax(logits.double(), -1).gather(-1, ids[:, 1:, None])[..., 0]  # [1, T-1]


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_rewriting_init_refuses_an_embedding_target(init: str) -> None:
    """PEFT decomposes linear weights only: an embedding target would get a trainable 'initial' adapter and
    an export that does not load, so it is a one-line ConfigError naming the module."""
    section = LoraSection(r=4, init=init, target_modules=("q_proj", "embed_tokens"))
    with pytest.raises(
        ConfigError, match=f"model.lora.init: '{init}': applies to linear layers only; .*embed_tokens"
    ):
        apply_lora(base_model("llama", torch.float32), section)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_rewriting_init_reference_is_the_starting_model(init: str, tmp_path) -> None:
    """At step 0 the reference (adapters off) is the plain model, exactly, and the policy equals it within
    the measured noise floor, though the trained adapter starts at the base's own directions. Negative
    control: PEFT's init alone leaves 'adapters off' at the residual, far from the starting model. Export
    gives a plain LoRA adapter (rank 2r) that reproduces the trained policy on a fresh base."""
    from peft import LoraConfig, PeftModel, get_peft_model

    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 30, 11, 4]])
    plain = base_model("llama", torch.float32)
    want = _logprobs(plain, ids)
    nudged = base_model("llama", torch.float32)
    with torch.no_grad():  # the floor: the same model with every weight moved by 2^-24 relative
        for p in nudged.parameters():
            p.mul_(1 + 2.0**-24 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    floor = float((_logprobs(nudged, ids) - want).abs().max())
    policy = apply_lora(base_model("llama", torch.float32), LoraSection(r=4, init=init))
    assert float(sum(p.detach().norm() for n, p in policy.named_parameters() if ".lora_B.default" in n)) > 0
    with adapters_disabled(AdaptersOff(policy)) as ref:
        assert torch.equal(_logprobs(ref, ids), want)
    assert float((_logprobs(policy, ids) - want).abs().max()) <= FACTOR * floor
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}  # after a reference pass too
    assert trainable and all(".default." in n for n in trainable)
    with peft_quiet():
        naive = get_peft_model(
            base_model("llama", torch.float32), LoraConfig(r=4, target_modules=list(LoraSection().target_modules),
            init_lora_weights=init),
        )  # fmt: skip
    with naive.disable_adapter():
        assert float((_logprobs(naive, ids) - want).abs().max()) > 100 * FACTOR * floor
    trained_like(policy)
    backend = TorchBackend(policy)
    backend.export_pretrained(tmp_path / "final")
    saved = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["init_lora_weights"]) == (8, 32, True)
    assert LoraSection(adapter=str(tmp_path / "final")).adapter  # a plain adapter: continuing from it works
    with peft_quiet():
        loaded = PeftModel.from_pretrained(base_model("llama", torch.float32), str(tmp_path / "final"))
    assert float((_logprobs(loaded, ids) - _logprobs(policy, ids)).abs().max()) <= FACTOR * floor
    saved["init_lora_weights"] = init  # an unconverted adapter would rewrite the base again on load
    (tmp_path / "final" / "adapter_config.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match="rewrite the base weights again"):
        LoraSection(adapter=str(tmp_path / "final"))


@pytest.mark.launch  # an end-to-end run: it starts its environment worker processes
def test_trainer_with_pissa_exports_the_trained_policy(tmp_path) -> None:
    """The trainer with PiSSA: KL 0 on the first update (the reference is the starting model), > 0 after;
    final-merged/ (the rank-2r export merged into a freshly loaded base) gives the trained policy."""
    from support.train_cases import TINY

    from treetrain.train.loop import Trainer
    from treetrain.train.metrics import read_metrics

    sets = [*TINY, "measure_memory_every=0", "model.lora.r=4", "model.lora.init=pissa", "loss.kl_coef=0.05"]
    sets += ["model.reference=base"]

    sets += [f"run_dir={tmp_path / 'a'}", "updates=2", "model.lora.export_merged=true"]
    straight = Trainer(load_config(None, sets), progress=False)
    straight.run()
    a = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert abs(a[0].kl) < 1e-6 and a[1].kl > 0
    _assert_merged_export_is_the_policy(straight, tmp_path / "a" / "final-merged")


def test_rewriting_init_exact_with_kl_matches_flat() -> None:
    """With PiSSA, `exact` with KL (reference: adapters off, in the scoring walk) equals flat."""
    make = lora_factory("qwen3", torch.float32, init="pissa")
    batch = make_batch(SHAPES["multi_level"](0), KL)
    floor = noise_floor(make, batch, KL, adapters_off_reference=True)
    flat_model = make()
    flat = flat_gradient(flat_model, batch, KL, AdaptersOff(flat_model))
    model = make()
    report = TreeReplay(
        model, KL, ReplayConfig(microbatch=2, chunk_size=5), ref_model=AdaptersOff(model)
    ).accumulate(batch)
    assert report.reference_walks == 0 and report.kl > 0
    assert all(p.grad is None for n, p in model.named_parameters() if ".initial." in n)  # stays frozen
    assert deviation(flat_grad(model), flat).abs <= FACTOR * floor


def test_wrapping_raises_no_library_future_warning() -> None:
    """PEFT before 0.22 asks transformers for the deprecated `is_gradient_checkpointing` on every wrap; the
    user cannot act on that, so `apply_lora` does not show it. The control shows such a PEFT alone warns
    (0.22 stopped; `peft_quiet` can go once the floor in pyproject.toml is 0.22)."""
    import warnings
    from importlib.metadata import version

    from packaging.version import Version
    from peft import LoraConfig, get_peft_model

    from treetrain.models.presets import tiny_model

    if Version(version("peft")) < Version("0.22"):
        with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
            get_peft_model(tiny_model("llama", vocab_size=64), LoraConfig(r=4, target_modules=["q_proj"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        apply_lora(tiny_model("llama", vocab_size=64), LoraSection(r=4))
