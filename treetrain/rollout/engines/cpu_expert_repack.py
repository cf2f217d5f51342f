"""After an in-place weight reload, vLLM's CPU build must pack a mixture of experts' weights again.

vLLM's CPU experts kernel reads the expert stacks in a packed layout of its own, made once after the first
load (`CPUUnquantizedExperts.process_weights_after_loading`). An in-place reload (`reload_weights`, what
every sync is) copies the new weights into those parameters in the checkpoint's row layout but skips the
packing (vLLM 0.32 re-packs only on the first load), so the kernel reads rows as packed blocks: a reload of
the very weights it already serves moves the sampled logprobs by several nats. `repack_cpu_experts(worker)`
runs on the engine's worker after each reload and packs every CPU experts layer's new weights, which makes
the engine's logprobs the trainer's again (tests/rollout/test_vllm_moe.py measures both).

GPU kernels read the checkpoint layout and are untouched (the function finds no CPU experts there).
"""

from __future__ import annotations

from typing import Any


def repack_cpu_experts(worker: Any) -> int:
    """Pack the reloaded weights of every CPU experts layer of `worker`'s model; how many it packed."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU experts kernel
        return 0
    model = worker.model_runner.get_model()
    packed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            experts.process_weights_after_loading(module)
            packed += 1
    return packed
