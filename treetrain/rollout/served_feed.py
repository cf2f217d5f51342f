"""Weights handed from the training ranks to a fleet of `vllm serve` processes, with no copy in memory.

An asynchronous run (`rollout.max_staleness` >= 1) on the `vllm` or `hf` engine keeps a *shadow* of the
policy for its sampler (`treetrain.rollout.weight_feed.WeightFeed`), which ZeRO-3 cannot afford: the whole
model on one rank. On `vllm-server` the servers hold the weights the sampler samples with, so the run
needs no shadow at all:

- after each optimizer step the training thread of **every** rank publishes the new version (`publish`):
  each rank runs the probe forward and each bucket's gather, collectives under ZeRO-3 that gather the
  model one bucket at a time, and rank 0 writes the buckets to
  `<run_dir>/engine-weights/published/v<version>/`;
- rank 0's sampler thread, the one client of the fleet, has every server load the newest published
  version between its engine steps (`sync`, once the scheduler interrupted the requests in flight). That
  is HTTP alone, no collective and no tensor, so it runs beside training; the interrupted samples go on
  under the new weights from the tokens they drew, each token recording the version that drew it.

A version published and superseded before the sampler took it is removed by the next publish; a version
the servers loaded is removed once they all hold a newer one (`ServedWeights.loaded_everywhere`).

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
    >>> feed = ServedFeed(Path(tempfile.mkdtemp()), None, version=0, writes=True)
    >>> feed.publish(model, 1)
    >>> feed.newest.path.name, feed.version, feed.due(0)
    ('v1', 1, True)
    >>> feed.publish(model, 2)  # version 1 was never taken: it goes
    >>> sorted(p.name for p in feed.newest.path.parent.iterdir())
    ['v2']
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from treetrain.rollout.engines.adapter_sync import AdapterFiles
from treetrain.rollout.engines.generation import GenerationEngine
from treetrain.rollout.engines.server_sync import PUBLISHED, Written, follow_write, write_version
from treetrain.rollout.weight_feed import SamplerStopped
from treetrain.runfs import remove_tree


class ServedFeed:
    """The newest published version of the weights, on disk; see the module docstring.

    `writes`: whether this rank writes the files (rank 0); the others only run the collectives of the write.
    `adapters`: where LoRA adapters go when they are served as adapters (None: the full weights).
    """

    def __init__(
        self, weights_dir: Path, adapters: AdapterFiles | None, *, version: int, writes: bool
    ) -> None:
        self.weights_dir, self.adapters, self.writes = weights_dir, adapters, writes
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.version = version
        """The newest published version (the trainer's, once it published)."""
        self.newest: Written | None = None
        """What the newest publish wrote (rank 0 only)."""
        self._taken = False
        """Whether the sampler took `newest` (then the engine removes it once a newer one is loaded)."""
        self.syncs = 0
        """Syncs carried out, for tests and logs."""

    def publish(self, model: Any, version: int) -> None:
        """Write `model`'s weights as `version` (training thread, every rank: a collective under ZeRO-3)."""
        if not self.writes:
            follow_write(model, self.adapters is not None)
            with self._lock:
                self.version = version
            return
        written = write_version(model, version, self.weights_dir, self.adapters, f"{PUBLISHED}/v{version}")
        with self._lock:
            stale = self.newest if self.newest is not None and not self._taken else None
            self.newest, self._taken, self.version = written, False, version
        if stale is not None and stale.path != written.path:
            remove_tree(self.weights_dir, stale.path)

    def due(self, engine_version: int) -> bool:
        """Whether a newer version than `engine_version` waits; raises `SamplerStopped` once `close` was
        called, which ends a growing rollout at its next safe point."""
        if self._closing.is_set():
            raise SamplerStopped("the sampler was closed")
        return self.version != engine_version

    def sync(self, engine: GenerationEngine) -> None:
        """Have `engine` (a `VLLMServerEngine` with no request in flight) load the newest published version
        into every server (rank 0's sampler thread)."""
        with self._lock:
            written, self._taken = self.newest, True
        if written is None:
            raise RuntimeError("ServedFeed.sync before the first publish")
        engine.load_written(written)  # type: ignore[attr-defined]
        self.syncs += 1

    @property
    def sampling_model(self) -> None:
        """No model samples in this process: the servers do."""
        return None

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def close(self) -> None:
        """Make every later `due` raise `SamplerStopped` (the sampler thread stops at its next safe point)."""
        self._closing.set()
