"""LoRA reaching vLLM as an adapter: the base weights are loaded once, and each sync sends megabytes.

A policy trained with `model.lora` is the base model plus low-rank adapters, and vLLM serves LoRA adapters
natively (`enable_lora`, a `LoRARequest` on each request). Sending the adapter alone (PEFT's
`save_pretrained` format, what `treetrain.models.lora.save_adapter` writes) costs the adapter's size per
sync; the merged copy costs the whole model's (`bench/lora_sync.py` measures both).

`lora_serving(model)` decides, before the engine starts, whether vLLM can serve the adapter. It cannot
when the adapter has parts vLLM's LoRA does not load: modules trained in full next to the adapters
(`modules_to_save`), a target module outside vLLM's LoRA layers (the attention and MLP projections), an
expert of a mixture of experts, or a rank above vLLM's largest. Then the engine falls back to merged full
weights (`weight_buckets`, bucketed deltas), and `LoraServing.line` says so once at start.

Each sync writes the adapter under a new name and id (`treetrain-v{version}`), has the engine load it and
drops the previous one: a request names the adapter of the version it samples with, and vLLM's prefix
cache keys its blocks by adapter, so no KV of an older adapter is reused.

Example:
    >>> from treetrain.models.lora import apply_lora
    >>> from treetrain.models.lora_config import LoraSection
    >>> from treetrain.models.presets import tiny_model
    >>> lora_serving(apply_lora(tiny_model("llama", vocab_size=64), LoraSection(r=4)))
    LoraServing(as_adapter=True, rank=8, reason='')
    >>> saved = apply_lora(tiny_model("llama", vocab_size=64), LoraSection(r=4, modules_to_save=("lm_head",)))
    >>> print(lora_serving(saved).line())
    LoRA goes to vLLM merged into full weights: it trains lm_head in full (modules_to_save), which vLLM's LoRA does not serve
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetrain.io import atomic_directory
from treetrain.models.lora import is_peft, save_adapter

VLLM_LORA_TARGETS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"}
)
"""Module names vLLM's LoRA layers wrap in the decoder families treetrain serves through vLLM."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for `max_lora_rank`."""


@dataclass(frozen=True)
class LoraServing:
    """How a LoRA policy reaches vLLM: as an adapter of at most `rank` (vLLM's `max_lora_rank`), or merged
    into full weights for `reason`."""

    as_adapter: bool
    rank: int
    reason: str

    def line(self) -> str:
        """One line for the start of a run."""
        if self.as_adapter:
            return f"LoRA goes to vLLM as an adapter (max_lora_rank {self.rank}); the base weights load once"
        return f"LoRA goes to vLLM merged into full weights: {self.reason}"


def _peft(model: Any) -> Any:
    return getattr(model, "module", model) if type(model).__name__ == "DeepSpeedEngine" else model


def _rank(model: Any) -> int:
    """The rank of the adapter as exported: twice the trained rank with the frozen PiSSA/OLoRA start."""
    from treetrain.models.lora import has_initial_adapter

    config = model.peft_config["default"]
    ranks = [int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())]
    return max(ranks) * (2 if has_initial_adapter(model) else 1)


def lora_serving(model: Any) -> LoraServing | None:
    """None for a model without LoRA; else how vLLM gets it (see the module docstring)."""
    model = _peft(model)
    if not is_peft(model):
        return None
    from peft.tuners.lora import LoraLayer

    rank = _rank(model)
    served = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    saved = sorted({n.split(".modules_to_save.")[0].rsplit(".", 1)[-1]
                    for n, _ in model.named_parameters() if ".modules_to_save." in n})  # fmt: skip
    adapted = {name for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    foreign = sorted({n.rsplit(".", 1)[-1] for n in adapted if n.rsplit(".", 1)[-1] not in VLLM_LORA_TARGETS})
    if saved:
        reason = f"it trains {', '.join(saved)} in full (modules_to_save), which vLLM's LoRA does not serve"
    elif any(".experts." in n for n in adapted):
        reason = "it adapts experts of a mixture of experts, which vLLM's LoRA does not serve here"
    elif foreign:
        reason = f"it adapts {', '.join(foreign)}, outside vLLM's LoRA layers ({', '.join(sorted(VLLM_LORA_TARGETS))})"
    elif served is None:
        reason = f"its rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}"
    else:
        return LoraServing(True, served, "")
    return LoraServing(False, 0, reason)


class AdapterFiles:
    """The adapter of each version as a PEFT directory under `root` (a fresh temporary one by default), the
    previous version's removed once the engine has the new one."""

    def __init__(self, root: str | Path | None = None) -> None:
        self._owned = root is None
        self.root = Path(tempfile.mkdtemp(prefix="treetrain-adapter-") if root is None else root)
        self.current: Path | None = None

    def write(self, model: Any, version: int) -> tuple[Path, int]:
        """Write `model`'s adapter for `version`; its directory and size in bytes."""
        final = self.root / f"adapter-v{version}"
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_directory(final) as tmp:
            save_adapter(_peft(model), Path(tmp))
        size = sum(p.stat().st_size for p in final.iterdir())
        return final, size

    def done(self, path: Path) -> None:
        """`path` is served now: the one before it is dropped."""
        if self.current is not None and self.current != path:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = path

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


def adapter_name(version: int) -> str:
    """The name an adapter version is served under.

    >>> adapter_name(3)
    'treetrain-v3'
    """
    return f"treetrain-v{version}"
