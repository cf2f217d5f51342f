"""`vllm serve` processes as the rollout engine, over HTTP.

`VLLMServerEngine(urls, ...)` sends each branch point to `/v1/completions` with the context as a token-id
`prompt`, `return_token_ids` and `logprobs=0`, and reads back each sample's token ids and logprobs:
nothing is detokenized on the way. Requests run on a thread pool, so every ready branch point of every
tree is in flight at once and the servers batch them.

**Streaming.** With `stream=True` (asynchronous training, where weights change while requests are in
flight) answers are read as server-sent events, so the engine knows each sample's tokens so far:
`interrupt` returns them, and closing an interrupted request's connection makes vLLM abort it.

**Routing.** With several URLs every request of one tree (`GenerationRequest.group`) goes to the same
server, chosen by a stable hash of the group, so that server's prefix cache holds the whole tree.

**What a server is.** At start each server's settings are read (`/v1/models`, `/server_info`) and one
that would sample something else than the trainer scores (another dtype, raw logprobs, no prefix cache, a
shorter context, a CPU build that splits prompts) is refused in one line naming the flag
(`treetrain.rollout.engines.server_checks`).

**Weight sync.** After each optimizer step the trainer's weights are written as safetensors under
`<run_dir>/engine-weights/current/` (atomically, readable by the server's user; ZeRO-3 gathered module by
module, a mixture of experts under its checkpoint's per-expert names, LoRA merged where vLLM cannot serve it
as an adapter), then each server is asked to reload them from that path (so a server on another machine needs
the run directory on a shared filesystem at the same path; `POST /collective_rpc` with `reload_weights`,
available when the server runs with `VLLM_SERVER_DEV_MODE=1`) and to reset its prefix cache. Each step must be
confirmed by its answer (the reload's `{"results": [null]}`, the reset's `{"success": true}`); then the
server's weight version is set to this sync's label (`POST /update_weight_version`, read back from
`GET /weight_info`) and a probe prompt is scored on it and compared with the trainer's logprobs. Whenever the
engine falls idle during a rollout the versions are read again, so a server restarted (its version is
`default` again) or reloaded by another run stops the rollout before its samples are trained on.

**LoRA.** With `lora=LoraServing(as_adapter=True, ...)` (`adapter_sync.lora_serving`) the servers keep the
base weights they started with; each sync writes the adapter under `<run_dir>/engine-weights/adapters/`,
each server loads it (`POST /v1/load_lora_adapter` as `treetrain-v{version}`) and unloads the previous one,
and every request names the current adapter as its `model`. The servers must run with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve ... --enable-lora --max-lora-rank R` (R at least the
adapter's rank).

**At the end.** `close()` removes what the syncs wrote (`current/`, a full copy of the weights, and
`adapters/`), and `weights_dir` when that leaves it empty: the servers read the files only while they reload.
After a sync that failed, when a reload may not have answered and its server may still be reading, they are
left in place.

**Bad servers.** A server that is down, answers with an HTTP error, stays silent past
`request_timeout_s`, or returns JSON outside the protocol (or more than `server_calls.MAX_RESPONSE_BYTES`) stops the
rollout with one `EngineError` line naming the URL and what was wrong; the update's trees are not written.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
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
    Interrupted,
    StopMatcher,
    completion_of,
)
from treetrain.rollout.engines.server_calls import ServerHTTPError, call_server, short
from treetrain.rollout.engines.server_checks import (
    Expected,
    ServedConfig,
    mismatch,
    probe_tolerance,
    served_config,
    served_prompt_logprobs,
    trainer_probe,
)
from treetrain.rollout.engines.server_stream import StreamedAnswer, stream_server
from treetrain.runfs import remove_tree

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64
"""Requests open at once across all servers."""
DEV_MODE = "start the server with VLLM_SERVER_DEV_MODE=1, which treetrain needs to read its settings and reload weights"


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
        expected: Expected,
        version: int = 0,
        lora: LoraServing | None = None,
        stream: bool = False,
    ) -> None:
        """`stream`: read answers as they are sampled (server-sent events), so that `interrupt` knows what
        each request drew so far; for weights that change while requests are in flight."""
        if not settings.urls:
            raise EngineError("rollout.engine=vllm-server needs rollout.vllm.urls (the servers' base URLs)")
        self.urls = tuple(u.rstrip("/") for u in settings.urls)
        self.timeout = settings.request_timeout_s
        self.weights_dir = Path(weights_dir)
        self.expected = expected
        self._adapters = (
            AdapterFiles(self.weights_dir / "adapters") if lora is not None and lora.as_adapter else None
        )
        self._adapter: str | None = None  # the served name of the current version's adapter
        if lora is not None:
            (log.info if lora.as_adapter else log.warning)("rollout.engine=vllm-server: %s", lora.line())
        self.version = version
        self.stats = EngineStats()
        self.served = tuple(self._check_server(url) for url in self.urls)
        self.models = tuple(s.model for s in self.served)
        self.label: str | None = None
        """The weight version every server was set to at the last sync (None before the first)."""
        self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="treetrain-vllm")
        self._done: queue.Queue[tuple[int, GenerationResult | EngineError]] = queue.Queue()
        self._open: set[int] = set()
        self._next_id = 0
        self.stream = stream
        self._lock = threading.Lock()  # guards `_open` and `_drawn` between the pool and `interrupt`
        self._drawn: dict[int, StreamedAnswer] = {}
        self._unanswered = False
        """Whether a server was asked to read the files under `weights_dir` and has not answered."""

    def _check_server(self, url: str) -> ServedConfig:
        """What `url` serves, refused in one line when it cannot sample for this run."""
        quick = min(self.timeout, 30.0)
        models = call_server(url, "/v1/models", None, quick)
        try:
            info = call_server(url, "/server_info?config_format=json", None, quick)
        except ServerHTTPError as exc:
            if exc.code != 404:
                raise
            raise EngineError(f"vllm-server {url}/server_info: not found: {DEV_MODE}") from None
        try:
            served = served_config(models, info)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise EngineError(
                f"vllm-server {url}: /v1/models or /server_info answered outside vLLM's protocol ({short(exc)})"
            ) from None
        problem = mismatch(served, self.expected)
        if problem is not None:
            raise EngineError(f"vllm-server {url} (serving {served.root}): {problem}")
        return served

    def _weight_version(self, url: str) -> str:
        answer = call_server(url, "/weight_info", None, min(self.timeout, 30.0))
        if not isinstance(answer, dict) or not isinstance(answer.get("weight_version"), str):
            raise EngineError(f"vllm-server {url}/weight_info: no weight_version in {short(answer)}")
        return str(answer["weight_version"])

    def check_versions(self, when: str) -> None:
        """Every server still holds the weights of the last sync; otherwise one line saying which does not."""
        if self.label is None:
            return
        for url in self.urls:
            found = self._weight_version(url)
            if found != self.label:
                raise EngineError(
                    f"vllm-server {url}: its weights are no longer this run's ({when} its weight version is "
                    f"{found!r}, expected {self.label!r}): it was restarted or reloaded by someone else; "
                    "continue with --resume, which reloads it"
                )

    # ----- GenerationEngine -------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> int:
        rid = self._next_id
        self._next_id += 1
        with self._lock:
            self._open.add(rid)
            if self.stream:
                self._drawn[rid] = StreamedAnswer(request, self.version)
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
                if rid not in self._open:  # aborted: its answer came back after all
                    item = self._done.get_nowait()
                    continue
                with self._lock:
                    self._open.discard(rid)
                    self._drawn.pop(rid, None)
                if isinstance(answer, EngineError):
                    raise answer
                results.append(answer)
                self.stats.cached_tokens += answer.cached_tokens
                self.stats.sampled_tokens += sum(len(c.tokens) for c in answer.completions)
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        if results and not self._open:  # idle: what was sampled so far came from this sync's weights
            self.check_versions("during the rollout")
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
            if self.stream:
                body.update(stream=True, stream_options={"include_usage": True})
                if not stream_server(
                    url, "/v1/completions", body, self.timeout, lambda e: self._event(rid, e)
                ):
                    return  # interrupted: `interrupt` answered for it
                with self._lock:  # kept until `poll` takes the answer: an `interrupt` before then returns it
                    drawn = self._drawn.get(rid) if rid in self._open else None
                    if drawn is None:
                        return
                    answer = drawn.answer()
            else:
                answer = call_server(url, "/v1/completions", body, self.timeout)
            result = self._parse(url, rid, answer, request, version)
        except EngineError as exc:
            self._done.put((rid, exc))
            return
        except Exception as exc:  # a bug here must still reach the rollout, not die in a pool thread
            self._done.put((rid, EngineError(f"vllm-server {url}: {type(exc).__name__}: {short(exc)}")))
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
                f"{where}: an answer outside the protocol ({short(exc)}): {short(answer)}"
            ) from None
        if len(completions) != request.n:
            raise EngineError(f"{where}: {len(completions)} samples for a request of n={request.n}")
        return GenerationResult(rid, tuple(completions), cached)

    def sync_weights(self, model: object, version: int) -> None:
        """Write the weights (or, with LoRA served as an adapter, only the adapter) under `weights_dir` and
        have every server load them, each step confirmed by its answer; then label and probe the served
        weights (see the module docstring)."""
        if self.busy:
            raise EngineError("vllm-server: sync_weights while requests are in flight (abort them first)")
        start = time.perf_counter()
        label = f"{self.weights_dir.resolve()}@{version}"
        probe = trainer_probe(model)
        path: Path | None = None
        if self._adapters is not None:
            self.stats.sync_bytes += self._load_adapter(model, version)
        else:
            from treetrain.rollout.engines.served_checkpoint import write_weights

            path = write_weights(model, self.weights_dir)
            self.stats.sync_bytes += sum(p.stat().st_size for p in path.iterdir())
        for url, served in zip(self.urls, self.served):
            if path is not None:
                self._reload(url, served, str(path))
        for url, served in zip(self.urls, self.served):
            answer = call_server(url, "/update_weight_version", {"new_version": label}, self.timeout)
            if not isinstance(answer, dict) or answer.get("new_version") != label:
                raise EngineError(f"vllm-server {url}/update_weight_version: not confirmed: {short(answer)}")
            self._probe(url, served, probe)
        self.label = label
        self.check_versions("after the reload")
        self.version = version
        self.stats.weight_syncs += 1
        self.stats.sync_seconds += time.perf_counter() - start

    def _reload(self, url: str, served: ServedConfig, path: str) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        try:
            answer = self._ask_to_read(url, "/collective_rpc", body)
        except ServerHTTPError as exc:
            raise EngineError(
                f"{exc}; it serves {served.root}: is that this run's model ({self.expected.path})?"
            ) from None
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results or any(r is not None for r in results):
            raise EngineError(
                f"vllm-server {url}/collective_rpc: the reload of {path} was not confirmed (the answer was "
                f"{short(answer)!r}, not one null result per worker)"
            )
        reset = call_server(url, "/reset_prefix_cache", {}, self.timeout)
        if not isinstance(reset, dict) or reset.get("success") is not True:
            raise EngineError(
                f"vllm-server {url}/reset_prefix_cache: the reset was not confirmed: {short(reset)}; its "
                "cache would hold KV of the old weights"
            )

    def _ask_to_read(self, url: str, endpoint: str, body: dict[str, Any]) -> Any:
        """`call_server` for a call that has the server read files under `weights_dir`: until it answers (an
        HTTP error is an answer, a timeout is not) the files are marked as possibly being read."""
        self._unanswered = True
        try:
            answer = call_server(url, endpoint, body, self.timeout)
        except ServerHTTPError:
            self._unanswered = False
            raise
        self._unanswered = False
        return answer

    def _probe(self, url: str, served: ServedConfig, probe: tuple[list[int], list[float]]) -> None:
        """Score the probe prompt on the server against the trainer's logprobs of it."""
        tokens, own = probe
        body = {"model": self._adapter or served.model, "prompt": tokens, "max_tokens": 1, "temperature": 1.0, "seed": 0,
                "prompt_logprobs": 0, "logprobs": 0}  # fmt: skip
        where = f"vllm-server {url}/v1/completions (the weight probe)"
        try:
            theirs = served_prompt_logprobs(call_server(url, "/v1/completions", body, self.timeout), tokens)
        except ServerHTTPError as exc:
            raise EngineError(f"{exc}; is {served.root} this run's model ({self.expected.path})?") from None
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise EngineError(f"{where}: an answer outside the protocol ({short(exc)})") from None
        gap = max(abs(a - b) for a, b in zip(own, theirs))
        tolerance = probe_tolerance(self.expected.dtype)
        if not gap <= tolerance:
            raise EngineError(
                f"{where}: its logprobs differ from the trainer's by up to {gap:.3g} (more than {tolerance:g}) "
                f"right after the reload: it does not serve the weights written to {self.weights_dir} (another "
                "copy of the run directory, or another model than model.path)"
            )

    def _load_adapter(self, model: object, version: int) -> int:
        """Every server loads the adapter under the version's name (`POST /v1/load_lora_adapter`, which a
        server offers with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` and `--enable-lora`) and drops the
        previous one; requests name it as their model. Its size in bytes."""
        assert self._adapters is not None
        path, size = self._adapters.write(model, version)
        name = adapter_name(version)
        for url in self.urls:
            try:
                self._ask_to_read(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            except EngineError as exc:
                raise EngineError(
                    f"{exc} (a server takes LoRA adapters when started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                    "and --enable-lora --max-lora-rank at least the adapter's rank)"
                ) from None
            if self._adapter is not None and self._adapter != name:
                call_server(url, "/v1/unload_lora_adapter", {"lora_name": self._adapter}, self.timeout)
        self._adapter = name
        self._adapters.done(path)
        return size

    def release_group(self, group: str) -> None:
        """vLLM's prefix cache evicts by itself."""

    def abort(self) -> None:
        """Forget every request in flight; their answers are dropped when they arrive."""
        with self._lock:
            self._open.clear()
            self._drawn.clear()

    def _event(self, rid: int, event: Any) -> bool:
        """Keep one streamed event's tokens; False once `rid` was interrupted or aborted (stop reading)."""
        with self._lock:
            drawn = self._drawn.get(rid)
            if rid not in self._open or drawn is None:
                return False
            drawn.add(event)
            return True

    def interrupt(self) -> list[Interrupted] | None:
        """With `stream`, stop every request and return what each sample drew (its streamed tokens so far);
        their connections close at their next event, which makes vLLM abort them. Without it, None: an
        answer comes back whole, so the scheduler lets requests in flight finish and syncs once idle."""
        if not self.stream:
            return None
        with self._lock:
            out = [Interrupted(rid, self._drawn.pop(rid).samples()) for rid in sorted(self._open)]
            self._open.clear()
        return out

    def close(self) -> None:
        """Stop sending, and remove the weights written for the servers (see the module docstring)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._unanswered:
            log.warning(
                "vllm-server: keeping %s: a server may still be reading it (its reload did not answer)",
                self.weights_dir,
            )
            return
        for written in ("current", "adapters"):
            remove_tree(self.weights_dir, self.weights_dir / written)
        with contextlib.suppress(OSError):  # kept when it holds anything else
            self.weights_dir.rmdir()
