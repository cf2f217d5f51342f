"""Build the inference engine a run names (`rollout.engine`), after every check that engine needs.

The trainer describes what it has in an `EngineSpec` (which engine, its settings, where the run lives, what
the model was loaded from, how it is distributed) and calls `make_engine(spec, model)`: it names no engine
class and imports no engine module, and every engine-specific refusal lives here, next to the engines it
protects. Each refusal is one `ConfigError` line naming the setting to change:

- `vllm-server` with more than one trainer process in a synchronous run without the ranks' gather (`ranks`):
  every rank samples its share and rank 0 leads each weight sync (`server_ranks`). An asynchronous run
  (`in_flight_weights`) makes this engine on rank 0 alone, the fleet's one client, which loads what every
  rank published (`treetrain.rollout.served_feed`);
- `vllm` or `vllm-server` with experts that stay fused even in the checkpoint layout (transformers' own
  conversion, reversed, gives no per-expert names for them: `expert_export`), or with LoRA under ZeRO-3 (adapters would have to be merged
  into partitioned weights);
- `vllm` with a model that is not a checkpoint directory (a built-in preset: vLLM loads from disk).

Engine modules are imported only when their engine is made, so that a run on `hf` never imports vLLM.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from dataclasses import replace
    >>> from treetrain.rollout.engines.engine_settings import VLLMSettings
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
    >>> spec = EngineSpec("hf", VLLMSettings(), run_dir="/tmp", model_path="tiny", checkpoint="tiny",
    ...     max_tokens=256)
    >>> type(make_engine(spec, model)).__name__
    'HFEngine'
    >>> make_engine(replace(spec, kind="vllm-server", world_size=2), model)
    Traceback (most recent call last):
    ...
    treetrain.errors.ConfigError: rollout.engine: 'vllm-server' with 2 trainer processes needs the ranks' gather (EngineSpec.ranks), which leads each weight sync from rank 0
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetrain.errors import ConfigError
from treetrain.rollout.engines.engine_settings import ENGINES, VLLMSettings
from treetrain.rollout.engines.generation import GenerationEngine
from treetrain.rollout.engines.sampler_process import SamplerProcess
from treetrain.rollout.engines.server_ranks import TrainerRanks


@dataclass(frozen=True)
class EngineSpec:
    """What the factory needs to know about a run to build (and refuse) its engine."""

    kind: str
    """`rollout.engine`: one of `ENGINES`."""
    vllm: VLLMSettings
    """`rollout.vllm`: how the vllm engine starts and the vllm-server engine connects."""
    run_dir: str | Path
    """The run directory (`vllm-server` writes the weights it reloads under `engine-weights/`)."""
    model_path: str
    """`model.path` as configured (named in refusals)."""
    checkpoint: str
    """Where `model.path` resolves to: a checkpoint directory, or a preset's name (`vllm` needs a directory)."""
    max_tokens: int
    """The longest context one call may have (the episode's token budget): the `vllm` engine's max length."""
    dtype: str = "float32"
    """`model.dtype`, which the `vllm` engine runs in."""
    seed: int = 0
    """The run's seed (the `vllm` engine's own seed)."""
    world_size: int = 1
    """Trainer processes."""
    lora_under_zero3: bool = False
    """Whether the policy has LoRA adapters and runs under DeepSpeed ZeRO-3."""
    hf_kv_bytes: int | None = None
    """Most bytes of KV the `hf` engine holds (live rows and kept prefixes); None: its own default."""
    in_flight_weights: bool = False
    """Whether weights change while requests are in flight (`rollout.max_staleness` >= 1, an asynchronous
    run's sampler): the `hf` engine then runs in a process of its own (`HFProcessEngine`; the model given to
    `make_engine` is the shared shadow it copies at each sync), and `vllm-server` streams its answers, so
    that a sync can interrupt them and resubmit each with its tokens so far."""
    threads: int | None = None
    """`threads`: torch threads of the `hf` engine's process (None: 1)."""
    ranks: TrainerRanks | None = None
    """The trainer's processes, when there are several and each samples its share (a synchronous run):
    `vllm-server`'s rank 0 leads each weight sync."""

    def __post_init__(self) -> None:
        if self.kind not in ENGINES:
            raise ConfigError(f"rollout.engine: must be one of {ENGINES}, got {self.kind!r:.80}")


def check_engine(spec: EngineSpec, model: Any) -> None:
    """Refuse, in one line naming the setting, an engine this run cannot use (see the module docstring)."""
    kind = spec.kind
    if kind == "vllm-server" and spec.world_size > 1 and spec.ranks is None and not spec.in_flight_weights:
        raise ConfigError(
            f"rollout.engine: 'vllm-server' with {spec.world_size} trainer processes needs the ranks' gather "
            "(EngineSpec.ranks), which leads each weight sync from rank 0"
        )
    if kind == "hf":
        return
    from treetrain.rollout.engines.weight_buckets import fused_experts

    fused = fused_experts(model)
    if fused is not None:
        raise ConfigError(
            f"rollout.engine: {kind!r} loads checkpoint-named weights, and this model's {fused} stays fused "
            "even in its checkpoint layout (transformers has no per-expert names for it); use 'hf'"
        )
    if spec.lora_under_zero3:
        raise ConfigError(
            f"rollout.engine: {kind!r} with LoRA under ZeRO-3 is not supported (the adapters would have to be "
            "merged into partitioned weights); use ZeRO 0-2 with LoRA, or rollout.engine='hf'"
        )
    if kind == "vllm" and not Path(spec.checkpoint).is_dir():
        raise ConfigError(
            f"rollout.engine: 'vllm' loads the model from a checkpoint directory, and model.path={spec.model_path!r} "
            "is a built-in preset; save it with save_pretrained and give that directory"
        )


def make_engine(spec: EngineSpec, model: Any, *, process: SamplerProcess | None = None) -> GenerationEngine:
    """The engine `spec.kind` names, serving `model`, at weight version -1 (synced before first use).
    `process`: the `hf` sampler process, spawned earlier, that the engine of an asynchronous `hf` run takes
    (closed here for any other engine)."""
    check_engine(spec, model)
    if spec.kind == "hf" and spec.in_flight_weights:
        from treetrain.rollout.engines.hf_process import HFProcessEngine

        return HFProcessEngine(
            model, version=-1, threads=spec.threads, max_kv_bytes=spec.hf_kv_bytes, process=process
        )
    if process is not None:
        process.close()
    if spec.kind == "hf":
        from treetrain.rollout.engines.hf_engine import HFEngine

        if spec.hf_kv_bytes is None:
            return HFEngine(model, version=-1)
        return HFEngine(model, version=-1, max_kv_bytes=spec.hf_kv_bytes)
    from treetrain.rollout.engines.adapter_sync import lora_serving

    if spec.kind == "vllm-server":
        from treetrain.rollout.engines.server_checks import Expected
        from treetrain.rollout.engines.vllm_server import VLLMServerEngine

        expected = Expected(
            path=spec.model_path,
            dtype=spec.dtype,
            max_model_len=spec.max_tokens,
            shape=Expected.shape_of(model.config),
        )
        return VLLMServerEngine(
            spec.vllm, weights_dir=Path(spec.run_dir) / "engine-weights", expected=expected, version=-1,
            lora=lora_serving(model), stream=spec.in_flight_weights, ranks=spec.ranks,
        )  # fmt: skip
    from treetrain.rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(
        spec.checkpoint, spec.vllm, dtype=spec.dtype, max_model_len=spec.max_tokens, seed=spec.seed,
        version=-1, lora=lora_serving(model),
    )  # fmt: skip
