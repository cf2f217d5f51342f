"""The `model.lora` settings, validated without importing torch, PEFT or transformers.

`treetrain.models.lora` wraps a policy with them; this module only checks them, so that a config error
(`treetrain train --set model.lora.r=0`) is reported before the heavy libraries load.

Example:
    >>> LoraSection(r=4).alpha, LoraSection(r=4).target_modules
    (16, ('q_proj', 'k_proj', 'v_proj', 'o_proj'))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from treetrain.errors import ConfigError
from treetrain.jsonfile import read_json_object

#: Projections present in every supported family (attention only: predictable, and small).
DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MAX_RANK = 1 << 14
"""Largest rank accepted: adapters are allocated from it, so a typo must not allocate gigabytes."""
ADAPTER_CONFIG = "adapter_config.json"
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
ADAPTER_WEIGHTS = "adapter_model.safetensors"
REWRITING_INITS = ("pissa", "olora")
"""Inits that rewrite the base weights (handled with the frozen `initial` adapter, see module docstring)."""


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters on the policy (PEFT). Set any field (e.g. `model.lora.r=8`) to turn them on."""

    r: int = 8
    """Rank of each adapter pair (A: r x in, B: out x r)."""
    alpha: int = 16
    """Scaling numerator: the adapter's output is multiplied by alpha / r."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Module names (suffixes) that get adapters, or ['all-linear'] for every linear layer but the head."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full next to the adapters (e.g. ['lm_head']); switched off with the adapters."""
    init: Literal["default", "gaussian", "pissa", "olora", "loftq"] = "default"
    """'default': A Kaiming-uniform, B = 0 (the policy starts as the base); 'gaussian': A normal, B = 0;
    'pissa' (principal singular vectors) or 'olora' (QR): the base's own directions, with a frozen copy
    of the starting adapter subtracted so the policy and the reference (adapters off) still start as the
    base; export gives a plain LoRA adapter of rank 2r. 'loftq' is refused (it needs a quantized base)."""
    dropout: float = 0.0
    """Must be 0: dropout makes two forwards of the same tokens differ, which breaks the exact contract."""
    adapter: str | None = None
    """A PEFT adapter directory to continue training from (its adapter_config.json then decides r, alpha,
    target_modules and modules_to_save, and those fields here must stay at their defaults)."""
    export_merged: bool = False
    """Also write `final-merged/`: the base with the adapters merged in, a plain Hugging Face model."""

    def __post_init__(self) -> None:
        if not 1 <= self.r <= MAX_RANK:
            raise ConfigError(f"model.lora.r: must be in [1, {MAX_RANK}], got {self.r}")
        if not self.alpha > 0:
            raise ConfigError(f"model.lora.alpha: must be > 0, got {self.alpha}")
        if not self.target_modules or any(not t for t in self.target_modules):
            raise ConfigError("model.lora.target_modules: name at least one module (or 'all-linear')")
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise ConfigError("model.lora.target_modules: 'all-linear' must be the only entry")
        if self.dropout != 0:
            raise ConfigError(
                f"model.lora.dropout: must be 0, got {self.dropout}: dropout draws a new mask on every forward, "
                "so the scoring pass, resident KV and replay of the same tokens would differ and the exact "
                "contract would not hold"
            )
        if self.init == "loftq":
            raise ConfigError(
                "model.lora.init: 'loftq' initializes adapters against a quantized base's quantization error, and "
                "treetrain trains unquantized weights; use 'pissa' or 'olora'"
            )
        if self.init in REWRITING_INITS and self.modules_to_save:
            raise ConfigError(
                f"model.lora.init: {self.init!r} keeps a frozen starting adapter active next to the trained one, "
                "which PEFT's modules_to_save does not support; leave model.lora.modules_to_save empty"
            )
        if self.adapter is not None:
            check_adapter_dir(self.adapter)
            custom = [
                name
                for name in ("r", "alpha", "target_modules", "modules_to_save", "init")
                if getattr(self, name) != getattr(LoraSection, name)
            ]
            if custom:
                raise ConfigError(
                    f"model.lora.{custom[0]}: the adapter in {self.adapter} decides it (its {ADAPTER_CONFIG}); "
                    "leave it unset when model.lora.adapter is given"
                )


def check_adapter_dir(path: str) -> dict[str, Any]:
    """The adapter's config, after checking the directory is a LoRA adapter with safetensors weights."""
    d = Path(path)
    cfg_file, weights = d / ADAPTER_CONFIG, d / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        raise ConfigError(
            f"model.lora.adapter: {path!r} is not a PEFT adapter directory (needs {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS})"
        )
    cfg = read_json_object(
        cfg_file, max_bytes=MAX_ADAPTER_CONFIG_BYTES, error=lambda m: ConfigError(f"model.lora.adapter: {m}")
    )
    if cfg.get("peft_type") != "LORA":
        raise ConfigError(f"model.lora.adapter: {cfg_file} is not a LoRA adapter config")
    init = str(cfg.get("init_lora_weights", True)).lower()
    if init.startswith(("pissa", "olora", "corda", "loftq", "eva", "lora_ga")):
        raise ConfigError(
            f"model.lora.adapter: {cfg_file} says init_lora_weights={init!r}: loading it would rewrite the base "
            "weights again; convert it to a plain LoRA adapter first (PEFT's path_initial_model_for_weight_"
            "conversion; treetrain's own exports already are)"
        )
    dropout = cfg.get("lora_dropout") or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise ConfigError(
            f"model.lora.adapter: {cfg_file}: lora_dropout must be a number, got {dropout!r:.40}"
        )
    return cfg
