"""The weight-sync half of `VLLMServerEngine`: keeping every serving server of the fleet at the trainer's
weights, and taking back a server that answers again.

Why a module of its own: the engine (`treetrain.rollout.engines.vllm_server`) sends requests and routes
them; this half runs between rollouts, when nothing is in flight, and is what changes with the transfer
(files reloaded by every server, `server_sync`; or streamed over gloo from rank 0, `served_stream`) and with
the number of trainer ranks (rank 0 syncs, the others follow, `server_ranks`). Each step is confirmed by
the server's answer; a server that does not answer is lost (`VLLMServerEngine._lose`), and when every
server is lost the sync stops with one line that `--resume` continues.

Example (a `VLLMServerEngine` is a `FleetSync`; it needs running servers, see tests/rollout):
    >>> engine.sync_weights(model, version=3)   # doctest: +SKIP
    >>> engine.label                            # doctest: +SKIP
    '/abs/run/engine-weights@3'
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

from treetrain.rollout.engines.generation import EngineError, EngineStats
from treetrain.rollout.engines.gloo_sender import BACKEND
from treetrain.rollout.engines.served_stream import StreamedWeights
from treetrain.rollout.engines.server_calls import PROBE_TIMEOUT, ServerLostError, call_server
from treetrain.rollout.engines.server_checks import Expected, ServedConfig, check_held, check_server
from treetrain.rollout.engines.server_fleet import Fleet
from treetrain.rollout.engines.server_ranks import SyncOutcome, TrainerRanks, share_outcome
from treetrain.rollout.engines.server_sync import ServedWeights, Written, version_label, write_version

log = logging.getLogger(__name__)


class FleetSync(ABC):
    """Weight sync and recovery over the engine's fleet; `VLLMServerEngine` sets every attribute below."""

    urls: tuple[str, ...]
    timeout: float
    weights_dir: Path
    expected: Expected
    ranks: TrainerRanks | None
    streamed: StreamedWeights | None
    weights: ServedWeights
    version: int
    stats: EngineStats
    served: list[ServedConfig]
    fleet: Fleet
    _lock: threading.Lock

    @property
    @abstractmethod
    def busy(self) -> bool:
        """Whether requests are in flight (the engine's ledger)."""

    @abstractmethod
    def _lose(self, server: int, why: EngineError) -> None:
        """Take `server` out of the fleet, its samples going on elsewhere (the engine's routing)."""

    @property
    def label(self) -> str | None:
        """The weight version every serving server was set to at the last sync (None before the first)."""
        return self.weights.label

    def check_versions(self, when: str) -> None:
        """Every serving server still holds the weights of the last sync; otherwise one line saying which
        does not. One that does not answer is lost."""
        if self.label is None:
            return
        for i in self.fleet.alive:
            try:
                check_held(self.urls[i], self.label, when, min(self.timeout, 30.0))
            except ServerLostError as exc:
                self._lose(i, exc)

    def _recover(self) -> None:
        """Probe the lost servers that are due; one that answers is checked, reloaded to the current weights
        and version, and takes work again."""
        with self._lock:
            due = self.fleet.to_probe()
        for i in due:
            url = self.urls[i]
            try:
                call_server(url, "/v1/models", None, PROBE_TIMEOUT)
            except EngineError:
                continue
            try:
                served = self._check_server(url)
                if self.streamed is not None and self.label is not None:
                    with self._lock:
                        self.served[i] = served
                    self.streamed.returning.add(i)
                    log.warning("vllm-server %s answers again; it takes work after the next weight sync", url)
                    continue
                if self.label is not None:
                    self.weights.load(url, served)
            except ServerLostError:
                continue
            except EngineError as exc:
                log.warning("vllm-server %s answers again but stays out of this run: %s", url, exc)
                continue
            with self._lock:
                self.served[i] = served
                self.fleet.back(i)
            log.warning(
                "vllm-server %s is back, reloaded to weight version %s; it takes work again", url, self.label
            )

    def sync_weights(self, model: object, version: int) -> None:
        """Write the weights (or, with LoRA served as an adapter, only the adapter) under `weights_dir` and
        have every serving server load them, each step confirmed by its answer; then label and probe the
        served weights (`server_sync`). A server lost meanwhile is reloaded when it is back. With several
        trainer ranks, rank 0 writes and loads, and the others follow (`server_ranks`)."""
        self._idle("sync_weights")
        start = time.perf_counter()
        if self.ranks is None:
            self._sync_everywhere(model, version)
        elif self.ranks.leads:
            failure: EngineError | None = None
            try:
                self._sync_everywhere(model, version)
            except EngineError as exc:
                failure = exc
            w = self.weights
            path = None if w.path is None else str(w.path)
            done = SyncOutcome(
                path, w.label, self.fleet.alive, w.adapter, None if failure is None else str(failure)
            )
            share_outcome(self.ranks, done)
            if failure is not None:
                raise failure
        else:
            self._follow(model)
        self._synced(version, start)

    def load_written(self, written: Written) -> None:
        """Have every serving server load `written`, which another thread wrote (an asynchronous run's
        training thread, `served_feed`): nothing here touches the model, so this runs beside training."""
        self._idle("load_written")
        start = time.perf_counter()
        self._load_everywhere(written)
        self._synced(written.version, start)

    def _idle(self, what: str) -> None:
        if self.busy:
            raise EngineError(f"vllm-server: {what} while requests are in flight (abort them first)")

    def _synced(self, version: int, start: float) -> None:
        self.version = version
        self.stats.weight_syncs += 1
        self.stats.sync_seconds += time.perf_counter() - start

    def _write(self, model: object, version: int) -> Written:
        return write_version(model, version, self.weights_dir, self.weights.adapters)

    def _sync_everywhere(self, model: object, version: int) -> None:
        if self.streamed is None:
            self._load_everywhere(self._write(model, version))
            return
        servers = {
            i: (self.urls[i], self.served[i]) for i in (*self.fleet.alive, *sorted(self.streamed.returning))
        }
        label = version_label(self.weights_dir, version)
        failed, sent = self.streamed.send(model, label, self.weights, servers)
        self.stats.sync_bytes += sent
        for i, exc in failed.items():
            if isinstance(exc, ServerLostError):
                self._lose(i, exc)
            elif i in self.fleet.alive:
                raise exc
            else:  # a server that came back, as a file reload that fails there
                log.warning("vllm-server %s answers again but stays out of this run: %s", self.urls[i], exc)
        for i in servers:
            if i not in failed and i not in self.fleet.alive:
                with self._lock:
                    self.fleet.back(i)
                log.warning(
                    "vllm-server %s is back at weight version %s; it takes work again", self.urls[i], label
                )
        if not self.fleet.alive:
            raise self._all_lost()
        self.check_versions("after the transfer")

    def _load_everywhere(self, written: Written) -> None:
        self.weights.take(written)
        self.stats.sync_bytes += written.size
        for i in self.fleet.alive:
            try:
                self.weights.load(self.urls[i], self.served[i])
            except ServerLostError as exc:
                self._lose(i, exc)
        if not self.fleet.alive:
            raise self._all_lost()
        self.weights.loaded_everywhere()
        self.check_versions("after the reload")

    def _follow(self, model: object) -> None:
        """Run the collectives of rank 0's write, then take what its sync left on the servers."""
        assert self.ranks is not None
        self.weights.follow(model)
        outcome = share_outcome(self.ranks, None)
        if outcome.error is not None:
            raise EngineError(f"rank 0's weight sync stopped: {outcome.error}")
        self.weights.adopt(outcome.path, outcome.label, outcome.adapter)
        for i in self.fleet.alive:
            if i not in outcome.alive:
                self._lose(i, EngineError(f"vllm-server {self.urls[i]}: lost at rank 0's weight sync"))
        if self.streamed is not None:  # a server rank 0 streamed to holds this sync's weights
            for i in set(outcome.alive) - set(self.fleet.alive):
                with self._lock:
                    self.fleet.back(i)
                self.streamed.returning.discard(i)
        if not self.fleet.alive:
            raise self._all_lost()
        self.check_versions("after rank 0's reload")

    def _check_server(self, url: str) -> ServedConfig:
        """What `url` serves, refused in one line when it cannot sample for this run."""
        transfer = None if self.streamed is None else BACKEND
        return check_server(url, self.expected, min(self.timeout, 30.0), transfer)

    def _all_lost(self) -> EngineError:
        whys = "; ".join(str(s.lost) for s in self.fleet.servers)
        return EngineError(
            f"{whys}; every server of rollout.vllm.urls is lost: start them again and continue with --resume"
        )
