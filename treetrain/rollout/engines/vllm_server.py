"""`vllm serve` processes as the rollout engine, over HTTP.

`VLLMServerEngine(urls, ...)` sends each branch point to `/v1/completions` with the context as a token-id
`prompt`, `return_token_ids` and `logprobs=0`, and reads back each sample's token ids and logprobs:
nothing is detokenized on the way. Requests run on a thread pool, so every ready branch point of every
tree is in flight at once and the servers batch them.

**Routing.** With several URLs every request of one tree (`GenerationRequest.group`) goes to the same
server, chosen by a stable hash of the group, so that server's prefix cache holds the whole tree.

**Weight sync.** After each optimizer step the trainer's weights are written as safetensors under
`<run_dir>/engine-weights/` (atomically; ZeRO-3 gathered module by module, a mixture of experts under its
checkpoint's per-expert names, LoRA merged where vLLM cannot serve it as an adapter), then each server is
asked to reload them from that path (so a server on another machine needs the run directory on a shared
filesystem at the same path) (`POST /collective_rpc` with `reload_weights`, available when the server runs with
`VLLM_SERVER_DEV_MODE=1`) and to reset its prefix cache. A server that fails to reload stops the run: its
samples would come from other weights than the trainer's.

**LoRA.** With `lora=LoraServing(as_adapter=True, ...)` (`adapter_sync.lora_serving`) the servers keep the
base weights they started with; each sync writes the adapter under `<run_dir>/engine-weights/adapters/`,
each server loads it (`POST /v1/load_lora_adapter` as `treetrain-v{version}`) and unloads the previous one,
and every request names the current adapter as its `model`. The servers must run with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve ... --enable-lora --max-lora-rank R` (R at least the
adapter's rank).

**Bad servers.** A server that is down, answers with an HTTP error, stays silent past
`request_timeout_s`, or returns JSON outside the protocol (or more than `MAX_RESPONSE_BYTES`) stops the
rollout with one `EngineError` line naming the URL and what was wrong; the update's trees are not written.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from treetrain.rollout.engines.adapter_sync import AdapterFiles, LoraServing, adapter_name
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import (
    Completion,
    EngineError,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    StopMatcher,
)
from treetrain.rollout.engines.vllm_engine import completion_of

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 64 * 2**20
"""Largest answer read from a server."""
MAX_IN_FLIGHT = 64
"""Requests open at once across all servers."""


def _short(text: object, limit: int = 160) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def route(group: str, n_servers: int) -> int:
    """The server of a group: a stable hash, the same in every process and run.

    >>> route("calculator-s7", 3) == route("calculator-s7", 3)
    True
    """
    return zlib.crc32(group.encode()) % n_servers


class VLLMServerEngine:
    """Requests to `vllm serve` processes; see the module docstring."""

    def __init__(
        self,
        settings: VLLMSettings,
        *,
        weights_dir: str | Path,
        version: int = 0,
        lora: LoraServing | None = None,
    ) -> None:
        if not settings.urls:
            raise EngineError("rollout.engine=vllm-server needs rollout.vllm.urls (the servers' base URLs)")
        self.urls = tuple(u.rstrip("/") for u in settings.urls)
        self.timeout = settings.request_timeout_s
        self.weights_dir = Path(weights_dir)
        self._adapters = (
            AdapterFiles(self.weights_dir / "adapters") if lora is not None and lora.as_adapter else None
        )
        self._adapter: str | None = None  # the served name of the current version's adapter
        if lora is not None:
            (log.info if lora.as_adapter else log.warning)("rollout.engine=vllm-server: %s", lora.line())
        self.version = version
        self.stats = EngineStats()
        self.models = tuple(self._served_model(url) for url in self.urls)
        self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="treetrain-vllm")
        self._done: queue.Queue[tuple[int, GenerationResult | EngineError]] = queue.Queue()
        self._open: set[int] = set()
        self._next_id = 0

    # ----- HTTP -------------------------------------------------------------------------------------
    def _call(self, url: str, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
        """POST `body` (GET when None) to `url + path`; the parsed JSON answer (None for an empty one)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            detail = _short(exc.read(2000).decode("utf-8", "replace")) if exc.fp else ""
            raise EngineError(f"vllm-server {url}{path}: HTTP {exc.code} {exc.reason}: {detail}") from None
        except urllib.error.URLError as exc:
            raise EngineError(f"vllm-server {url}{path}: cannot connect: {_short(exc.reason)}") from None
        except TimeoutError:
            raise EngineError(f"vllm-server {url}{path}: no answer within {timeout:g}s") from None
        except (
            OSError,
            http.client.HTTPException,
            ValueError,
        ) as exc:  # a reset, a bad status line, a short read
            raise EngineError(f"vllm-server {url}{path}: {type(exc).__name__}: {_short(exc)}") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise EngineError(f"vllm-server {url}{path}: an answer over {MAX_RESPONSE_BYTES} bytes")
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EngineError(
                f"vllm-server {url}{path}: the answer is not JSON ({exc}): {_short(raw[:200])}"
            ) from None

    def _served_model(self, url: str) -> str:
        answer = self._call(url, "/v1/models", None, min(self.timeout, 30.0))
        try:
            return str(answer["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"vllm-server {url}/v1/models: no served model in {_short(answer)}") from None

    # ----- GenerationEngine -------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> int:
        rid = self._next_id
        self._next_id += 1
        self._open.add(rid)
        self.stats.requests += 1
        self.stats.prompt_tokens += request.prompt_tokens
        self._pool.submit(self._run, rid, request, self.version, self._adapter)
        return rid

    @property
    def busy(self) -> bool:
        return bool(self._open)

    def poll(self) -> list[GenerationResult]:
        """The requests answered so far (waits up to 50 ms for the first); a failed one raises."""
        results: list[GenerationResult] = []
        try:
            item = self._done.get(timeout=0.05)
            while True:
                rid, answer = item
                self._open.discard(rid)
                if isinstance(answer, EngineError):
                    raise answer
                results.append(answer)
                self.stats.cached_tokens += answer.cached_tokens
                self.stats.sampled_tokens += sum(len(c.tokens) for c in answer.completions)
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        return results

    def _run(self, rid: int, request: GenerationRequest, version: int, adapter: str | None) -> None:
        server = route(request.group, len(self.urls))
        url = self.urls[server]
        body = {
            "model": adapter or self.models[server], "prompt": list(request.context), "n": request.n,
            "max_tokens": request.max_new_tokens, "temperature": request.sampling.temperature,
            "top_p": request.sampling.top_p, "seed": request.seed, "logprobs": 0,
            "stop_token_ids": list(request.stop_ids), "ignore_eos": True, "skip_special_tokens": False,
            "return_token_ids": True, "include_stop_str_in_output": True,
        }  # fmt: skip
        try:
            answer = self._call(url, "/v1/completions", body, self.timeout)
            result = self._parse(url, rid, answer, request, version)
        except EngineError as exc:
            self._done.put((rid, exc))
            return
        except Exception as exc:  # a bug here must still reach the rollout, not die in a pool thread
            self._done.put((rid, EngineError(f"vllm-server {url}: {type(exc).__name__}: {_short(exc)}")))
            return
        self._done.put((rid, result))

    def _parse(
        self, url: str, rid: int, answer: Any, request: GenerationRequest, version: int
    ) -> GenerationResult:
        where = f"vllm-server {url}/v1/completions"
        stops = StopMatcher.of(request.stop)
        try:
            choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
            completions: list[Completion] = []
            for choice in choices:
                ids = choice["token_ids"]
                lps = choice["logprobs"]["token_logprobs"]
                if (
                    not isinstance(ids, list)
                    or not isinstance(lps, list)
                    or len(ids) != len(lps)
                    or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
                    or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in lps)
                ):
                    raise ValueError(
                        "token_ids and logprobs.token_logprobs must be equal-length lists of numbers"
                    )
                completions.append(completion_of(ids, lps, choice.get("finish_reason"), stops, version))
            usage = answer.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EngineError(
                f"{where}: an answer outside the protocol ({_short(exc)}): {_short(answer)}"
            ) from None
        if len(completions) != request.n:
            raise EngineError(f"{where}: {len(completions)} samples for a request of n={request.n}")
        return GenerationResult(rid, tuple(completions), cached)

    def sync_weights(self, model: object, version: int) -> None:
        """Write the weights (or the LoRA adapter) under `weights_dir` and have every server load them."""
        if self.busy:
            raise RuntimeError("sync_weights while requests are in flight")
        start = time.perf_counter()
        if self._adapters is not None:
            self.stats.sync_bytes += self._load_adapter(model, version)
        else:
            from treetrain.rollout.engines.served_checkpoint import write_weights

            path = write_weights(model, self.weights_dir)
            self.stats.sync_bytes += sum(p.stat().st_size for p in path.iterdir())
            for url in self.urls:
                self._call(
                    url,
                    "/collective_rpc",
                    {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
                    self.timeout,
                )
                self._call(url, "/reset_prefix_cache", {}, self.timeout)
        self.version = version
        self.stats.weight_syncs += 1
        self.stats.sync_seconds += time.perf_counter() - start

    def _load_adapter(self, model: object, version: int) -> int:
        """Every server loads the adapter under the version's name (`POST /v1/load_lora_adapter`, which a
        server offers with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` and `--enable-lora`) and drops the
        previous one; requests name it as their model. Its size in bytes."""
        assert self._adapters is not None
        path, size = self._adapters.write(model, version)
        name = adapter_name(version)
        for url in self.urls:
            try:
                self._call(
                    url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, self.timeout
                )
            except EngineError as exc:
                raise EngineError(
                    f"{exc} (a server takes LoRA adapters when started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                    "and --enable-lora --max-lora-rank at least the adapter's rank)"
                ) from None
            if self._adapter is not None and self._adapter != name:
                self._call(url, "/v1/unload_lora_adapter", {"lora_name": self._adapter}, self.timeout)
        self._adapter = name
        self._adapters.done(path)
        return size

    def release_group(self, group: str) -> None:
        """vLLM's prefix cache evicts by itself."""

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
