"""`rollout.vllm.weight_sync: gloo`: each version streamed from the trainer into every server, no files.

The file path (`treetrain.rollout.engines.server_sync`) needs a filesystem the servers share with the
trainer, writes a full copy per version and has every server read it back. Here rank 0 streams the weights
bucket by bucket (`weight_buckets`: under ZeRO-3 one gathered module at a time, so no rank ever holds the
whole model) into each server through vLLM's own weight-transfer API over a gloo group
(`treetrain.rollout.engines.gloo_sender`), and each bucket is packed once whatever the number of servers.
After the stream every server resets its prefix cache (its KV is of the old weights), is labelled with the
version and scores the probe prompt against the trainer's logprobs, as after a file reload
(`ServedWeights.confirm`).

A server that fails during a sync is lost (the run goes on at the others). One that answers again cannot be
loaded on the spot, as a file reload can: the weights exist only in the trainer's live model, which by then
may have moved on, and under ZeRO-3 gathering them is a collective of every rank. So it waits in
`returning` and takes the next sync's stream before it gets work.
"""

from __future__ import annotations

import threading
from typing import Any

from treetrain.rollout.engines.generation import EngineError
from treetrain.rollout.engines.gloo_sender import GlooSender, stream
from treetrain.rollout.engines.server_calls import call_server, short
from treetrain.rollout.engines.server_checks import ServedConfig, trainer_probe
from treetrain.rollout.engines.server_sync import ServedWeights


class StreamedWeights:
    """This rank's transfer groups, one per server; see the module docstring. `forget` may come from another
    thread (a request's thread that lost its server), so the groups are kept under a lock."""

    def __init__(self, host: str, timeout: float) -> None:
        self.host, self.timeout = host, timeout
        self.senders: dict[int, GlooSender] = {}
        self.returning: set[int] = set()
        """Servers that answer again after being lost, waiting for the next sync."""
        self._lock = threading.Lock()

    def connect(self, servers: dict[int, str]) -> None:
        """Form the group with each server now (at start: a server its workers cannot reach from, a wrong
        `transfer_host`, is refused in one line before any update)."""
        for i, url in servers.items():
            sender = GlooSender(url, self.host, self.timeout)
            with self._lock:
                self.senders[i] = sender

    def send(
        self, model: Any, label: str, weights: ServedWeights, servers: dict[int, tuple[str, ServedConfig]]
    ) -> tuple[dict[int, EngineError], int]:
        """Stream `model` into `servers` (index -> URL and settings) as version `label`, then reset, label and
        probe each; the servers that failed, and the bytes sent. The probe forward and every bucket's gather
        run whatever fails, in the order `follow_write` runs them on the other ranks."""
        from treetrain.rollout.engines.weight_buckets import weight_buckets

        weights.streamed(label, trainer_probe(model))
        failed: dict[int, EngineError] = {}
        live: dict[int, GlooSender] = {}
        for i, (url, _) in servers.items():
            with self._lock:
                sender = self.senders.get(i)
            try:
                live[i] = sender or GlooSender(url, self.host, self.timeout)
            except EngineError as exc:
                failed[i] = exc
        with self._lock:
            self.senders.update(live)
        before = sum(s.sent_bytes for s in live.values())
        failed |= stream(live, weight_buckets(model))
        sent = sum(s.sent_bytes for s in live.values()) - before
        for i, (url, served) in servers.items():
            if i not in failed:
                try:
                    reset = call_server(url, "/reset_prefix_cache", {}, self.timeout)
                    if not isinstance(reset, dict) or reset.get("success") is not True:
                        raise EngineError(
                            f"vllm-server {url}/reset_prefix_cache: not confirmed: {short(reset)}"
                        )
                    weights.confirm(url, served)
                except EngineError as exc:
                    failed[i] = exc
            if i in failed:  # its end of the group is in an unknown state: a new one forms next time
                self.forget(i)
        self.returning -= set(servers)
        return failed, sent

    def forget(self, i: int) -> None:
        """Server `i` was lost: its group is gone with it."""
        with self._lock:
            self.senders.pop(i, None)

    def close(self) -> None:
        with self._lock:
            senders, self.senders = list(self.senders.values()), {}
        for sender in senders:
            sender.close()
