"""`vllm serve` processes as the rollout engine, over HTTP.

`VLLMServerEngine(urls, ...)` sends each branch point to `/v1/completions` with the context as a token-id
`prompt`, `return_token_ids` and `logprobs=0`, and reads back each sample's token ids and logprobs:
nothing is detokenized on the way. Requests run on a thread pool, so every ready branch point of every
tree is in flight at once and the servers batch them.

**Streaming.** With `stream=True` (asynchronous training, where weights change while requests are in
flight), and whenever there are several servers, answers are read as server-sent events, so the engine
knows each sample's tokens so far: `interrupt` returns them, closing an interrupted request's connection
makes vLLM abort it, and a lost server's samples go on elsewhere from them.

**Routing** (`treetrain.rollout.engines.server_fleet`). A tree's requests (`GenerationRequest.group`) stay
on the server its first went to while that server has room, so its prefix cache holds the tree; otherwise
they go to the least loaded server, by the queue depth and KV-cache use its `GET /metrics` reports.

**A lost server.** A server that refuses or drops the connection, stays silent past `request_timeout_s`, or
ends a stream early is lost: one warning line names it, `servers_lost` counts it, and each sample it held
goes on at another server from the tokens it drew, their sampler logprobs kept
(`treetrain.rollout.engines.server_parts`). A lost server is probed every `server_fleet.PROBE_EVERY_S`;
once it answers, its settings are checked again and it is reloaded to the current weights and version
(streamed weights: at the next sync) before it gets work. When every server is lost the rollout stops
with one line, which `--resume` continues.

**What a server is.** At start each server's settings are read (`/v1/models`, `/server_info`) and one
that would sample something else than the trainer scores (another dtype, raw logprobs, no prefix cache, a
shorter context, a CPU build that splits prompts) is refused in one line naming the flag
(`treetrain.rollout.engines.server_checks`).

**Weight sync** (`treetrain.rollout.engines.fleet_sync`). After each optimizer step every serving server takes the new weights, resets its prefix
cache, is labelled with the sync's weight version and scores a probe prompt against the trainer's logprobs,
every step confirmed by its answer. With `rollout.vllm.weight_sync: files` (`server_sync`) they are written
as safetensors under `<run_dir>/engine-weights/` (with LoRA served as an adapter, the adapter) and each
server reloads them (`VLLM_SERVER_DEV_MODE=1`); with `gloo` (`served_stream`) rank 0 streams them into each
server through vLLM's weight-transfer API. Whenever the engine falls idle during a rollout the versions are
read again, so a server restarted or reloaded by another run stops the rollout before its samples are
trained on.

**Bad servers.** A server that answers with an HTTP error or with JSON outside the protocol (or more than
`server_calls.MAX_RESPONSE_BYTES`) stops the rollout with one `EngineError` line naming the URL and what
was wrong; the update's trees are not written. `close()` removes what the syncs wrote, unless a reload did
not answer and its server may still be reading it.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from treetrain.rollout.engines.adapter_sync import LoraServing
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.fleet_sync import FleetSync
from treetrain.rollout.engines.generation import (
    EngineError,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    Interrupted,
)
from treetrain.rollout.engines.served_stream import StreamedWeights
from treetrain.rollout.engines.server_calls import (
    ServerLostError,
    call_server,
    fetch_text,
    short,
)
from treetrain.rollout.engines.server_checks import Expected
from treetrain.rollout.engines.server_fleet import MAX_METRICS_BYTES, Fleet, ServerLoad, read_load
from treetrain.rollout.engines.server_parts import Ledger, Part
from treetrain.rollout.engines.server_ranks import TrainerRanks
from treetrain.rollout.engines.server_stream import parse_completions, stream_server
from treetrain.rollout.engines.server_sync import ServedWeights

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64
"""Requests open at once across all servers."""
METRICS_TIMEOUT_S = 2.0
"""Longest a `/metrics` read may take (a server that does not answer it is routed by its samples in flight)."""


class VLLMServerEngine(FleetSync):
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
        ranks: TrainerRanks | None = None,
    ) -> None:
        """`stream`: read answers as they are sampled (server-sent events), so that `interrupt` knows what
        each request drew so far; for weights that change while requests are in flight. `ranks`: the trainer's
        processes when there are several, each with an engine of its own (`server_ranks`)."""
        if not settings.urls:
            raise EngineError("rollout.engine=vllm-server needs rollout.vllm.urls (the servers' base URLs)")
        self.urls = tuple(u.rstrip("/") for u in settings.urls)
        self.timeout = settings.request_timeout_s
        self.weights_dir = Path(weights_dir)
        self.expected = expected
        self.ranks = ranks
        self.streamed = (
            StreamedWeights(settings.transfer_host, self.timeout) if settings.weight_sync == "gloo" else None
        )
        if self.streamed is not None and lora is not None:  # streamed weights are full ones
            lora = LoraServing(False, lora.rank, "rollout.vllm.weight_sync=gloo streams full weights")
        self.weights = ServedWeights(
            self.weights_dir, expected, self.timeout, lora, writes=ranks is None or ranks.leads
        )
        if lora is not None:
            (log.info if lora.as_adapter else log.warning)("rollout.engine=vllm-server: %s", lora.line())
        self.version = version
        self.stats = EngineStats()
        self.served = [self._check_server(url) for url in self.urls]
        self.fleet = Fleet(self.urls, [s.max_num_seqs for s in self.served], first=ranks.rank if ranks else 0)
        if self.streamed is not None and self.weights.writes:  # the rank that sends forms the groups now
            self.streamed.connect(dict(enumerate(self.urls)))
        self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="treetrain-vllm")
        self._done: queue.Queue[tuple[int, EngineError | None]] = queue.Queue()
        """Requests answered whole (None) or failed, by id, as the pool threads finish them."""
        self._next_id = 0
        self.stream = stream or len(self.urls) > 1
        self._lock = threading.Lock()  # guards `_ledger` and `fleet` between the pool and the caller
        self._ledger = Ledger()

    # ----- GenerationEngine -------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> int:
        rid = self._next_id
        self._next_id += 1
        with self._lock:
            part = self._ledger.open(rid, request, self.version, self.weights.adapter)
        self.stats.requests += 1
        self.stats.prompt_tokens += request.prompt_tokens
        self._pool.submit(self._run, part.pid)
        return rid

    @property
    def busy(self) -> bool:
        return bool(self._ledger.held)

    def poll(self) -> list[GenerationResult]:
        """The requests answered so far (waits up to 50 ms for the first); a failed one raises."""
        results: list[GenerationResult] = []
        try:
            self._take(results)
        finally:
            self._count()
        self._recover()
        if results and not self.busy:  # idle: what was sampled so far came from this sync's weights
            self.check_versions("during the rollout")
            self._read_loads(now=True)  # the queue times of what was just answered
            self._count()
        return results

    def _count(self) -> None:
        """The fleet's counts into `stats`, where the rollout reads them."""
        with self._lock:
            self.stats.servers, self.stats.servers_lost = self.fleet.stats(), self.fleet.servers_lost

    def _take(self, results: list[GenerationResult]) -> None:
        """Add the requests answered so far to `results`; raise the first that failed."""
        try:
            item = self._done.get(timeout=0.05)
            while True:
                rid, error = item
                with self._lock:
                    held = rid in self._ledger.held
                    if held and error is not None:
                        self._ledger.drop(rid)
                    answer = self._ledger.take(rid) if held and error is None else None
                if error is not None and held:
                    raise error
                if answer is not None:
                    results.append(answer)
                    self.stats.cached_tokens += answer.cached_tokens
                    self.stats.sampled_tokens += sum(len(c.tokens) for c in answer.completions)
                item = self._done.get_nowait()
        except queue.Empty:
            pass

    def _body(self, part: Part, server: int) -> dict[str, object]:
        request = part.request
        body: dict[str, object] = {
            "model": part.adapter or self.served[server].model, "prompt": list(request.context), "n": request.n,
            "max_tokens": request.max_new_tokens, "temperature": request.sampling.temperature,
            "top_p": request.sampling.top_p, "seed": request.seed, "logprobs": 0,
            "stop_token_ids": list(request.stop_ids), "ignore_eos": True, "skip_special_tokens": False,
            "return_token_ids": True, "include_stop_str_in_output": True,
        }  # fmt: skip
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def _run(self, pid: int) -> None:
        """Send part `pid` to the server the fleet picks and keep its answer (in a pool thread)."""
        self._read_loads()
        with self._lock:
            part = self._ledger.parts.get(pid)
            if part is None:  # aborted or interrupted before it was sent
                return
            server = self.fleet.pick(
                part.request.group, part.request.n, self._ledger.in_flight(len(self.urls))
            )
            if server is not None:
                part.server = server
                self.fleet.sent(server, part.request.n)
        if server is None:
            self._done.put((part.rid, self._all_lost()))
            return
        url = self.urls[server]
        try:
            if self.stream:
                if not stream_server(url, "/v1/completions", self._body(part, server), self.timeout,
                                     lambda e: self._event(pid, e)):  # fmt: skip
                    return  # interrupted or aborted: `interrupt` answered for it
                with self._lock:  # kept until `poll` takes the answer: an `interrupt` before then returns it
                    if pid not in self._ledger.parts:
                        return
                    answer = part.streamed.answer()
            else:
                answer = call_server(url, "/v1/completions", self._body(part, server), self.timeout)
            parsed = parse_completions(
                f"vllm-server {url}/v1/completions", answer, part.request, part.version
            )
        except ServerLostError as exc:
            self._lose(server, exc)
            return
        except EngineError as exc:
            self._done.put((part.rid, exc))
            return
        except Exception as exc:  # a bug here must still reach the rollout, not die in a pool thread
            self._done.put((part.rid, EngineError(f"vllm-server {url}: {type(exc).__name__}: {short(exc)}")))
            return
        with self._lock:
            self._ledger.answered(pid, parsed.completions, parsed.cached)
            if self._ledger.complete(part.rid):
                self._done.put((part.rid, None))

    def _event(self, pid: int, event: object) -> bool:
        """Keep one streamed event's tokens; False once part `pid` was interrupted, aborted or lost (stop
        reading, which closes the connection)."""
        with self._lock:
            part = self._ledger.parts.get(pid)
            if part is None:
                return False
            part.streamed.add(event)
            return True

    def _lose(self, server: int, why: EngineError) -> None:
        """`server` did not answer: every part on it goes on elsewhere from what its samples drew."""
        url = self.urls[server]
        with self._lock:
            newly = self.fleet.lost(server, str(why))
            rest: list[Part] = []
            affected = set()
            for pid in self._ledger.on(server):
                affected.add(self._ledger.parts[pid].rid)
                rest += self._ledger.lost(pid)
            for rid in affected:
                if self._ledger.complete(rid):
                    self._done.put((rid, None))
            self.weights.forget(url)
            if self.streamed is not None:
                self.streamed.forget(server)
            alive = len(self.fleet.alive)
        if newly and alive:
            log.warning(
                "vllm-server %s is lost (%s); %d of its samples go on at the other servers from the tokens they "
                "drew, %d of %d servers left (servers_lost in metrics.jsonl)",
                url, why, sum(p.request.n for p in rest), alive, len(self.urls),
            )  # fmt: skip
        elif newly:
            log.warning("vllm-server %s is lost (%s); no server is left", url, why)
        for part in rest:
            self._pool.submit(self._run, part.pid)

    def _read_loads(self, now: bool = False) -> None:
        """Read the metrics of the serving servers whose last read is due (`now`: of every one; see
        `server_fleet`)."""
        with self._lock:
            due = self.fleet.to_read(now)
        for i in due:
            load: ServerLoad | None = None
            try:
                text = fetch_text(self.urls[i], "/metrics", METRICS_TIMEOUT_S, MAX_METRICS_BYTES)
                load = read_load(text) if text is not None else None
            except (EngineError, ValueError) as exc:
                log.debug("vllm-server %s/metrics: %s", self.urls[i], exc)
            with self._lock:
                self.fleet.observe(i, load)

    def release_group(self, group: str) -> None:
        """vLLM's prefix cache evicts by itself; the group's server is forgotten."""
        with self._lock:
            self.fleet.release(group)

    def abort(self) -> None:
        """Forget every request in flight; their answers are dropped when they arrive."""
        with self._lock:
            self._ledger.clear()

    def interrupt(self) -> list[Interrupted] | None:
        """When streaming, stop every request and return what each sample drew (its streamed tokens so far);
        their connections close at their next event, which makes vLLM abort them. Otherwise None: an answer
        comes back whole, so the scheduler lets requests in flight finish and syncs once idle."""
        if not self.stream:
            return None
        with self._lock:
            return self._ledger.interrupt()

    def close(self) -> None:
        """Stop sending, and remove the weights written for the servers (see the module docstring)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.streamed is not None:
            self.streamed.close()
        if not self.weights.remove():
            log.warning(
                "vllm-server: keeping %s: a server may still be reading it (its reload did not answer)",
                self.weights_dir,
            )
