"""The kinds of layer a family's code builds, so a tiny model checked for the support table can be held to
carrying them: a support check on a tiny model without its family's conv layers, its sliding window or its
experts says nothing about a real checkpoint that has them.

Read from code and configs, never from a list per family. A family's *layer kinds* are the module classes
its decoder layers construct (found in the `__init__` sources of the decoder-layer classes, and of the
classes those construct, in the family's modeling module) whose names say they mix tokens or route
experts (`KIND_WORDS`: attention, convolutions, Mamba and other recurrent mixers, indexers, experts and
routers); towers of other modalities and kernel variants are left out (`OTHER_TOWERS`). A family's
*layer types* are the values of its config's per-layer type lists (`TYPE_LISTS`) as its default config,
the published architecture's, has them.

Example:
    >>> from treetrain.models.presets import tiny_model
    >>> sorted(layer_kinds(tiny_model("qwen3_next", 64)))
    ['Qwen3NextAttention', 'Qwen3NextExperts', 'Qwen3NextGatedDeltaNet', 'Qwen3NextSparseMoeBlock', 'Qwen3NextTopKRouter']
    >>> missing_kinds(tiny_model("llama", 64))
    []
"""

from __future__ import annotations

import inspect
import re
import sys

from torch import nn
from transformers import PretrainedConfig

from treetrain.models.decoder import decoder_layers

#: Words in a class name (after the family's prefix) that make it a layer kind.
KIND_WORDS = re.compile(r"Attention|Conv|Mamba|Mixer|Delta|Indexer|Expert|MoE|Moe|Router|Recurrent|Rglru")
#: Classes of another tower or of another kernel for the same layer: not a kind the text decoder lacks.
OTHER_TOWERS = re.compile(r"Vision|Audio|Multimodal|MultiModal|Cross|Encoder|Flash|Sdpa|Speech|Image|Video")
#: Config fields that list one type per layer.
TYPE_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types")


def _prefix(model: nn.Module) -> str:
    """The family's class-name prefix (`Qwen3Moe` of `Qwen3MoeForCausalLM`)."""
    name = type(model).__name__
    return re.split(r"For[A-Z]|LMHead|Model$|Decoder$", name)[0]


def _constructed(cls: type, module_name: str) -> set[type]:
    """Module classes of `module_name` that `cls.__init__` constructs by name."""
    try:
        source = inspect.getsource(cls.__init__)  # type: ignore[misc]
    except (OSError, TypeError):
        return set()
    module = sys.modules[module_name]
    found = (getattr(module, name, None) for name in re.findall(r"\b([A-Z]\w+)\(", source))
    return {
        c for c in found if isinstance(c, type) and issubclass(c, nn.Module) and c.__module__ == module_name
    }


def layer_kinds(model: nn.Module, *, built: bool = True) -> frozenset[str]:
    """Names of the layer-kind classes the model holds (`built`), or that its decoder layers' code can
    construct (`built=False`)."""
    prefix = _prefix(model)
    module_name = type(model).__module__

    def kind(cls: type) -> bool:
        rest = cls.__name__.removeprefix(prefix)
        ours = cls.__module__ == module_name
        return ours and bool(KIND_WORDS.search(rest)) and not OTHER_TOWERS.search(rest)

    if built:
        return frozenset(type(m).__name__ for m in model.modules() if kind(type(m)))
    seen: set[type] = set()
    todo = list({type(block) for block in decoder_layers(model)})  # type: ignore[arg-type]
    while todo:
        for cls in _constructed(todo.pop(), module_name) - seen:
            seen.add(cls)
            todo.append(cls)
    return frozenset(c.__name__ for c in seen if kind(c))


def missing_kinds(model: nn.Module) -> list[str]:
    """The layer kinds the family's code can construct that this model does not hold."""
    return sorted(layer_kinds(model, built=False) - layer_kinds(model))


def layer_types(config: PretrainedConfig) -> frozenset[str]:
    """Every per-layer type the config lists (`TYPE_LISTS`)."""
    config = config.get_text_config(decoder=True)
    return frozenset(str(t) for f in TYPE_LISTS for t in (getattr(config, f, None) or ()))


#: Layer-kind words that mean experts.
_EXPERTS = re.compile(r"Expert|MoE|Moe|Router")


def describe(model: nn.Module, probe_length: int) -> str:
    """What a model holds that the support check runs through, for the support table: its layer types,
    a sliding window or attention chunk shorter than `probe_length`, KV shared across layers, experts."""
    config = model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]
    parts = [f"{int(getattr(config, 'num_hidden_layers', 0) or len(decoder_layers(model)))} layers"]  # type: ignore[arg-type]
    types = sorted({str(t) for t in getattr(config, "layer_types", None) or ()})  # attention and mixers
    if types:
        parts.append(", ".join(types))
    for name, label in (("sliding_window", "window"), ("attention_chunk_size", "chunk")):
        size = getattr(config, name, None)
        if (
            isinstance(size, int)
            and size < probe_length
            and getattr(config, "use_sliding_window", True) is not False
        ):
            parts.append(f"{label} {size}")
    shared = getattr(config, "num_kv_shared_layers", None)
    if isinstance(shared, int) and shared > 0:
        parts.append(f"{shared} KV-sharing layers")
    prefix = _prefix(model)
    if any(_EXPERTS.search(k.removeprefix(prefix)) for k in layer_kinds(model)):
        parts.append("experts")
    return "; ".join(parts)
