"""LoRA adapters through PEFT: the `model.lora` settings, wrapping a policy, and the reference for free.

Why adapters: only the low-rank matrices train, so the base model needs no gradient and no optimizer state,
and the KL reference is the same weights with the adapters switched off (`AdaptersOff`): no second copy.

Inits that rewrite the base (PiSSA, OLoRA) start the trained adapter at the base's principal (or QR)
directions and subtract them from the base weights. treetrain restores the base weights afterwards and adds
a second, frozen adapter `initial` holding minus the starting adapter, so the policy still starts as the
base model and "adapters off" is exactly the starting model: the reference stays free, and the trained
adapter moves from PiSSA's (or OLoRA's) starting point. Exported, the two become one plain LoRA adapter of
twice the rank for the unmodified base (`save_adapter`, the conversion PEFT's
`path_initial_model_for_weight_conversion` does).

Exactness: the engine splits sequences and reuses resident KV, so two forwards of the same tokens must give
the same numbers. LoRA dropout draws a new mask on every forward, so `dropout > 0` is refused. An adapter
loaded from a directory that was trained with dropout gets it forced to 0 (with a warning): its weights
are valid, only the training-time noise is dropped.

PEFT is imported only when a model is wrapped, so loading a config stays fast.

Example:
    >>> from treetrain.models.presets import tiny_model
    >>> policy = apply_lora(tiny_model("llama", vocab_size=64), LoraSection(r=4))
    >>> sum(p.numel() for p in policy.parameters() if p.requires_grad)
    1792
    >>> with adapters_disabled(AdaptersOff(policy)) as base:
    ...     type(base).__name__
    'PeftModel'
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from treetrain.errors import ConfigError
from treetrain.models.lora_config import (
    ADAPTER_WEIGHTS,
    REWRITING_INITS,
    LoraSection,
    check_adapter_dir,
)

log = logging.getLogger(__name__)

DEFAULT, INITIAL = "default", "initial"
"""PEFT adapter names: the trained adapter, and (PiSSA, OLoRA) the frozen negated starting adapter."""


@contextlib.contextmanager
def peft_quiet() -> Iterator[None]:
    """Wrap a model with PEFT without its `is_gradient_checkpointing` FutureWarning: PEFT asks transformers
    for the deprecated name on every wrap, a skew between the two libraries that the user cannot act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


def _check_every_adapter_weight_loaded(peft_model: Any, weights: Path) -> None:
    """PEFT only warns when an adapter's weights name modules the model lacks (an adapter trained on another
    base model), and the run would then train fresh adapters instead: refuse that."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            saved = set(f.keys())
    except (OSError, SafetensorError) as exc:
        raise ConfigError(
            f"model.lora.adapter: {weights} is not a readable safetensors file: {exc}"
        ) from None
    loaded = {name.replace(".default", "") for name, _ in peft_model.named_parameters()}
    missing = sorted(saved - loaded)
    if missing:
        raise ConfigError(
            f"model.lora.adapter: {len(missing)} of the adapter's {len(saved)} weights name modules this model "
            f"does not have (e.g. {missing[0]}); was the adapter trained on another base model?"
        )


def apply_lora(model: PreTrainedModel, section: LoraSection) -> Any:
    """`model` wrapped in a PEFT `PeftModel` with trainable adapters; every base parameter frozen."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if section.adapter is not None:
        saved = check_adapter_dir(section.adapter)
        config = LoraConfig.from_pretrained(section.adapter)
        if float(saved.get("lora_dropout") or 0.0) != 0.0:
            log.warning(
                "model.lora.adapter: %s was trained with lora_dropout=%s; it is set to 0 here, because dropout "
                "breaks the exact contract (the weights are unchanged)",
                section.adapter,
                saved["lora_dropout"],
            )
            config.lora_dropout = 0.0
        try:
            with peft_quiet():
                peft_model = PeftModel.from_pretrained(
                    model, section.adapter, config=config, is_trainable=True
                )
        except (ValueError, RuntimeError, KeyError, OSError) as exc:  # another base model's adapter
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"model.lora.adapter: {section.adapter} does not fit this model: {first}"
            ) from None
        _check_every_adapter_weight_loaded(peft_model, Path(section.adapter) / ADAPTER_WEIGHTS)
    else:
        targets: Any = (
            "all-linear" if section.target_modules == ("all-linear",) else list(section.target_modules)
        )
        config = LoraConfig(
            r=section.r,
            lora_alpha=section.alpha,
            lora_dropout=0.0,
            target_modules=targets,
            modules_to_save=list(section.modules_to_save) or None,
            init_lora_weights="gaussian" if section.init == "gaussian" else True,
        )
        try:
            with peft_quiet():
                peft_model = get_peft_model(model, config)
        except ValueError as exc:
            raise ConfigError(f"model.lora.target_modules: {exc}") from None
        if section.init in REWRITING_INITS:
            try:
                _start_from_base_directions(peft_model, section.init, config)
            except (TypeError, ValueError) as exc:  # PEFT refuses some dtypes (float64)
                raise ConfigError(f"model.lora.init: {section.init!r}: {exc}") from None
    for name, p in peft_model.named_parameters():
        if p.requires_grad and not is_adapter_param(name):
            raise RuntimeError(f"PEFT left base parameter {name} trainable")
    return peft_model


@torch.no_grad()
def _start_from_base_directions(peft_model: Any, init: str, config: Any) -> None:
    """PEFT's PiSSA/OLoRA init of the `default` adapter, then the base weights restored and a frozen
    `initial` adapter of minus the starting adapter added: policy = W + BA - B0A0, equal to W at the start,
    and adapters off = W (see module docstring)."""
    from peft.tuners.lora import LoraLayer

    # PEFT decomposes linear weights only; an embedding (or conv) adapter would keep its plain init, and the
    # frozen `initial` copy and the rank-2r export below are defined for lora_A/lora_B pairs alone.
    other = sorted(
        n for n, m in peft_model.named_modules() if isinstance(m, LoraLayer) and DEFAULT not in m.lora_A
    )
    if other:
        raise ValueError(
            f"applies to linear layers only; model.lora.target_modules also matches {other[0]!r} "
            f"({type(peft_model.get_submodule(other[0]).get_base_layer()).__name__})"
        )
    peft_model.add_adapter(INITIAL, copy.deepcopy(config))  # init True: B = 0, the base untouched
    layers: list[Any] = [m for m in peft_model.modules() if isinstance(m, LoraLayer) and DEFAULT in m.lora_A]
    for layer in layers:
        weight = layer.get_base_layer().weight
        original = weight.detach().clone()
        if init == "pissa":
            layer.pissa_init(DEFAULT, "pissa")  # W -> W - B0 A0 (scaled), in place
        else:
            layer.olora_init(DEFAULT)
        weight.data.copy_(original)
        layer.lora_A[INITIAL].weight.copy_(layer.lora_A[DEFAULT].weight)
        layer.lora_B[INITIAL].weight.copy_(-layer.lora_B[DEFAULT].weight)
        # PEFT's declaration of adapter weights that stay frozen: every later `set_adapter` (including the
        # one that ends `disable_adapter()`, the reference pass) re-freezes them.
        layer.frozen_peft_weight_names = {**layer.frozen_peft_weight_names, INITIAL: ("lora_A", "lora_B")}
    peft_model.base_model.set_adapter([DEFAULT, INITIAL])
    for name, p in peft_model.named_parameters():
        if f".{INITIAL}." in name:
            p.requires_grad_(False)


def has_initial_adapter(model: Any) -> bool:
    """Whether `model` carries the frozen starting adapter of a PiSSA/OLoRA init."""
    return is_peft(model) and INITIAL in getattr(model, "peft_config", {})


def save_adapter(model: Any, directory: Path, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write `model`'s trained adapter as a PEFT adapter directory for the unmodified base model.

    A plain init is PEFT's `save_pretrained`. With the frozen `initial` adapter (PiSSA, OLoRA) the two
    adapters are written as one of twice the rank, A' = [A; A0'], B' = [B, -B0] with alpha doubled (the
    same scale), the conversion PEFT's `path_initial_model_for_weight_conversion` makes. `state_dict`:
    the full weights when the module's own are partitioned (ZeRO-3).
    """
    if not has_initial_adapter(model):
        model.save_pretrained(str(directory), **({"state_dict": dict(state_dict)} if state_dict else {}))
        return
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    sd = dict(state_dict) if state_dict is not None else None
    trained = get_peft_model_state_dict(model, state_dict=sd, adapter_name=DEFAULT)
    start = get_peft_model_state_dict(model, state_dict=sd, adapter_name=INITIAL)
    out = {}
    for key, value in trained.items():
        if ".lora_A." not in key and ".lora_B." not in key:  # `_start_from_base_directions` refuses others
            raise ValueError(f"cannot export {key!r} as part of a rank-2r LoRA adapter")
        dim = 0 if ".lora_A." in key else 1  # A [r, in] stacks rows, B [out, r] stacks columns
        out[key] = torch.cat([value, start[key]], dim=dim).detach().cpu().contiguous()
    config = copy.deepcopy(model.peft_config[DEFAULT])
    config.r, config.lora_alpha, config.init_lora_weights = 2 * config.r, 2 * config.lora_alpha, True
    config.inference_mode = True
    directory.mkdir(parents=True, exist_ok=True)
    save_file(out, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(str(directory))


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name belongs to a LoRA adapter or a `modules_to_save` copy."""
    return ".lora_" in name or ".modules_to_save." in name


def is_peft(model: object) -> bool:
    """A PEFT wrapper (checked by class, without importing PEFT)."""
    return type(model).__module__.startswith("peft.")


def unwrap(model: Any) -> PreTrainedModel:
    """The Hugging Face model inside a PEFT wrapper (adapter layers injected), or `model` itself."""
    return model.get_base_model() if is_peft(model) else model


@dataclass(frozen=True, eq=False)
class AdaptersOff:
    """The reference model for free: `model`, a PEFT-wrapped policy, evaluated with its adapters disabled.

    The engine enters `adapters_disabled` around the reference pass; no weights are copied. Its resident
    identity says adapters 'off', so its KV can never be read as the policy's (`ResidentIdentity.of`).
    """

    model: Any

    def __post_init__(self) -> None:
        if not is_peft(self.model):
            raise TypeError(
                f"AdaptersOff needs a PEFT-wrapped model, got {type(self.model).__name__}: without adapters "
                "'adapters off' would be the policy itself and the KL term would be zero"
            )


#: A reference model: its own weights, or the policy with adapters off.
Reference = PreTrainedModel | AdaptersOff


@contextlib.contextmanager
def adapters_disabled(ref: Reference) -> Iterator[Any]:
    """The model to run for reference `ref`, with the adapters off while the block lasts if it is `AdaptersOff`."""
    if isinstance(ref, AdaptersOff):
        with ref.model.disable_adapter():
            yield ref.model
    else:
        yield ref


def reference_module(ref: Reference | None) -> PreTrainedModel | None:
    """The module whose parameters a reference holds, or None when it shares the policy's."""
    return None if ref is None or isinstance(ref, AdaptersOff) else ref


def adapter_state(model: Any) -> str:
    """'none' without PEFT adapters, else 'on' or 'off' (what `ResidentIdentity` records)."""
    if not is_peft(model):
        return "none"
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        return "none"
    if all(m.disable_adapters for m in layers):
        return "off"
    active = sorted({a for m in layers for a in m.active_adapters})
    return "on" if active in ([DEFAULT], [DEFAULT, INITIAL]) else "on:" + ",".join(active)
