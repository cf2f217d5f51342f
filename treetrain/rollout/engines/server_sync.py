"""The weights `vllm serve` processes sample with: written once per sync, then loaded by each server.

`write_version` writes the trainer's weights as safetensors under `<weights_dir>/current/` (or, with
LoRA served as an adapter, the adapter under `<weights_dir>/adapters/`) and scores the probe prompt on the
trainer; `load(url, served)` has one server take them: `POST /collective_rpc` with `reload_weights` and
`POST /reset_prefix_cache` (or `POST /v1/load_lora_adapter` and the previous adapter's unload), each
confirmed by its answer, then its weight version set to the sync's label (`POST /update_weight_version`)
and the probe scored on it against the trainer's logprobs. A sync loads every serving server; a lost server
that answers again is loaded the same way before it gets work. Until a server answers a call that has it
read the files, they are marked as possibly being read (`unanswered`), and kept at the end.

The write and the load are apart (`write_version` returns a `Written`, `ServedWeights.take` makes it the one
the servers load), so that another thread may write while a rollout samples: an asynchronous run writes
each version on the training thread under `<weights_dir>/published/v<version>/` and its sampler thread has
the servers load the newest (`treetrain.rollout.served_feed`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetrain.rollout.engines.adapter_sync import AdapterFiles, LoraServing, adapter_name
from treetrain.rollout.engines.generation import EngineError
from treetrain.rollout.engines.server_calls import ServerHTTPError, call_server, short
from treetrain.rollout.engines.server_checks import (
    Expected,
    ServedConfig,
    probe_tolerance,
    served_prompt_logprobs,
    trainer_probe,
)
from treetrain.runfs import remove_tree

PUBLISHED = "published"
"""Where an asynchronous run's feed writes each version, `<weights_dir>/published/v<version>/`."""


@dataclass(frozen=True)
class Written:
    """One version of the weights on disk, ready for the servers to load."""

    version: int
    path: Path
    """The directory a server loads: the full weights, or the version's adapter."""
    label: str
    """The weight version label the servers are set to: `<weights_dir>@<version>`."""
    probe: tuple[tuple[int, ...], tuple[float, ...]]
    """The probe prompt and the trainer's logprob of each of its tokens after the first, at this version."""
    adapter: str | None
    """The served adapter's name, when LoRA is served as an adapter."""
    size: int
    """Bytes written."""


def version_label(weights_dir: Path, version: int) -> str:
    """The weight version label the servers are set to for `version` of the run whose weights go to
    `weights_dir` (whether or not anything is written there)."""
    return f"{weights_dir.resolve()}@{version}"


def write_version(
    model: Any, version: int, weights_dir: Path, adapters: AdapterFiles | None, name: str = "current"
) -> Written:
    """Write `model`'s weights as `version` under `weights_dir/name` (a complete directory replaces the
    old), or its adapter under `adapters`, and score the probe prompt on it."""
    tokens, own = trainer_probe(model)
    label = version_label(weights_dir, version)
    if adapters is not None:
        path, size = adapters.write(model, version)
        return Written(version, path, label, (tuple(tokens), tuple(own)), adapter_name(version), size)
    from treetrain.rollout.engines.served_checkpoint import write_weights

    path = write_weights(model, weights_dir, name)
    size = sum(p.stat().st_size for p in path.iterdir())
    return Written(version, path, label, (tuple(tokens), tuple(own)), None, size)


def served_adapters(weights_dir: Path, lora: LoraServing | None) -> AdapterFiles | None:
    """Where each version's adapter is written when LoRA is served as an adapter (None: the full weights)."""
    return AdapterFiles(weights_dir / "adapters") if lora is not None and lora.as_adapter else None


def follow_write(model: Any, adapters: bool) -> tuple[list[int], list[float]]:
    """What `write_version` runs on the model, without writing: the probe forward and each bucket's gather
    (under ZeRO-3 both are collectives that the writing rank runs too); the probe."""
    from treetrain.rollout.engines.weight_buckets import weight_buckets

    probe = trainer_probe(model)
    if not adapters:
        for _ in weight_buckets(model):
            pass
    return probe


class ServedWeights:
    """What the last sync wrote, and how a server takes it; see the module docstring."""

    def __init__(
        self,
        weights_dir: Path,
        expected: Expected,
        timeout: float,
        lora: LoraServing | None,
        writes: bool = True,
    ) -> None:
        """`writes`: whether this process writes the files (False: another trainer rank does, and this one
        loads them into a server that comes back, `follow` and `adopt`)."""
        self.weights_dir, self.expected, self.timeout, self.writes = weights_dir, expected, timeout, writes
        self.adapters = served_adapters(weights_dir, lora)
        self.adapter: str | None = None
        """The served name of the current version's adapter, which requests name as their model."""
        self.path: Path | None = None
        """The directory the servers load: the full weights, or the current adapter."""
        self.probe: tuple[list[int], list[float]] = ([], [])
        self.label: str | None = None
        """The weight version label of the last write (None before the first)."""
        self.unanswered = False
        """Whether a server was asked to read the files and has not answered."""
        self.loaded: dict[str, str] = {}
        """The adapter each server holds (dropped when it takes the next)."""
        self.previous: Path | None = None
        """The directory the servers loaded before `path` (a published version's goes once all hold `path`)."""

    def take(self, written: Written) -> None:
        """`written` is what the servers load next (and what a server that comes back is reloaded to)."""
        self.previous = self.path
        self.path, self.label, self.probe, self.adapter = (
            written.path,
            written.label,
            (list(written.probe[0]), list(written.probe[1])),
            written.adapter,
        )

    def follow(self, model: Any) -> None:
        """What `write_version` runs on the model, without writing (another rank writes: `follow_write`)."""
        self.probe = follow_write(model, self.adapters is not None)

    def adopt(self, path: str | None, label: str | None, adapter: str | None) -> None:
        """The writing rank's sync: the servers hold `path` under `label` (and `adapter`)."""
        self.path, self.label, self.adapter = (None if path is None else Path(path)), label, adapter

    def streamed(self, label: str, probe: tuple[list[int], list[float]]) -> None:
        """The servers take version `label` streamed, not from files (`served_stream`); `probe` is the
        trainer's at that version."""
        self.previous, self.path, self.label, self.probe, self.adapter = None, None, label, probe, None

    def load(self, url: str, served: ServedConfig) -> None:
        """Server `url` takes the written weights, is labelled with their version, and passes the probe."""
        assert self.path is not None and self.label is not None
        if self.adapters is not None:
            self._load_adapter(url)
        else:
            self._reload(url, served, str(self.path))
        self.confirm(url, served)

    def confirm(self, url: str, served: ServedConfig) -> None:
        """Server `url`, which holds the new weights, is labelled with their version and passes the probe."""
        assert self.label is not None
        answer = call_server(url, "/update_weight_version", {"new_version": self.label}, self.timeout)
        if not isinstance(answer, dict) or answer.get("new_version") != self.label:
            raise EngineError(f"vllm-server {url}/update_weight_version: not confirmed: {short(answer)}")
        self._probe(url, served)

    def loaded_everywhere(self) -> None:
        """Every server holds the written weights: the previous adapter's files go, and the previous
        published version's (`served_feed`)."""
        if self.adapters is not None and self.path is not None:
            self.adapters.done(self.path)
        old = self.previous
        if (
            self.writes
            and old is not None
            and old != self.path
            and old.parent == self.weights_dir / PUBLISHED
        ):
            remove_tree(self.weights_dir, old)
        self.previous = None

    def forget(self, url: str) -> None:
        """Server `url` was lost: whatever it held is gone (a restarted server holds no adapter)."""
        self.loaded.pop(url, None)

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

    def _load_adapter(self, url: str) -> None:
        """`POST /v1/load_lora_adapter` (offered with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` and
        `--enable-lora`) under the version's name, then the server's previous adapter is unloaded."""
        assert self.adapter is not None
        try:
            self._ask_to_read(
                url, "/v1/load_lora_adapter", {"lora_name": self.adapter, "lora_path": str(self.path)}
            )
        except EngineError as exc:
            raise EngineError(
                f"{exc} (a server takes LoRA adapters when started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                "and --enable-lora --max-lora-rank at least the adapter's rank)"
            ) from None
        previous = self.loaded.get(url)
        if previous is not None and previous != self.adapter:
            call_server(url, "/v1/unload_lora_adapter", {"lora_name": previous}, self.timeout)
        self.loaded[url] = self.adapter

    def _ask_to_read(self, url: str, endpoint: str, body: dict[str, Any]) -> Any:
        """`call_server` for a call that has the server read files under `weights_dir`: until it answers (an
        HTTP error is an answer, a timeout is not) the files are marked as possibly being read."""
        self.unanswered = True
        try:
            answer = call_server(url, endpoint, body, self.timeout)
        except ServerHTTPError:
            self.unanswered = False
            raise
        self.unanswered = False
        return answer

    def _probe(self, url: str, served: ServedConfig) -> None:
        """Score the probe prompt on the server against the trainer's logprobs of it."""
        tokens, own = self.probe
        body = {"model": self.adapter or served.model, "prompt": tokens, "max_tokens": 1, "temperature": 1.0,
                "seed": 0, "prompt_logprobs": 0, "logprobs": 0}  # fmt: skip
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

    def remove(self) -> bool:
        """Remove what the syncs wrote (and `weights_dir` when that empties it); False, removing nothing,
        while a server may still be reading it. A process that does not write removes nothing."""
        if not self.writes:
            return True
        if self.unanswered:
            return False
        for written in ("current", "adapters", PUBLISHED):
            remove_tree(self.weights_dir, self.weights_dir / written)
        with contextlib.suppress(OSError):  # kept when it holds anything else
            self.weights_dir.rmdir()
        return True
