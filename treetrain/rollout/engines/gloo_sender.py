"""The trainer's end of a weight transfer to a `vllm serve` over gloo, through vLLM's weight-transfer API.

vLLM 0.32 takes new weights without the disk through its RL routes: `/init_weight_transfer_engine` once,
then per sync `/start_weight_update`, one `/update_weights` per chunk, `/finish_weight_update`. Its own
engines are NCCL (GPU) and CUDA IPC; `treetrain.rollout.engines.gloo_transfer` is the same dense broadcast
over gloo, so a server on CPU (or on a machine that shares no NCCL group with the trainer) is reached too.
A server started with `--weight-transfer-config '{"backend": "treetrain_gloo"}'` loads it through
treetrain's `vllm.general_plugins` entry point.

`GlooSender` is the trainer's side of one server: a gloo group of the trainer (rank 0, the TCP store's
host) and the server's workers. `stream(senders, buckets, label)` sends `weight_buckets(model)` to every
server: each bucket is one `/update_weights` call (its names, dtypes and shapes) answered by one broadcast
of its bytes, so a ZeRO-3 rank holds one gathered bucket at a time and a server loads it through its
layerwise reload.

The wire layout of a chunk is `chunk_layout`: each tensor at an offset aligned to `ALIGN` bytes, so the
receiver views its slice in the tensor's own dtype without a copy.

Example:
    >>> chunk_layout([[2, 3], [5]], ["float32", "bfloat16"])
    ([0, 32], 48)
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from treetrain.rollout.engines.generation import EngineError
from treetrain.rollout.engines.server_calls import ServerLostError, call_server, short

BACKEND = "treetrain_gloo"
"""The name a server's `--weight-transfer-config` gives this engine."""
ALIGN = 16
"""Byte alignment of each tensor in a chunk."""
DTYPES = ("float32", "float16", "bfloat16", "float64")
"""The dtypes a chunk may carry: a model's floating-point weights."""
MAX_WORKERS = 4096
"""Most workers a server may report (its tensor, pipeline and data parallel ranks)."""
TIMEOUT_S = 300.0
"""How long a broadcast or a route may take, unless the caller says."""
JOIN_S = 60.0
"""How long a server's workers may take to join the group."""


def chunk_layout(shapes: Sequence[Sequence[int]], dtype_names: Sequence[str]) -> tuple[list[int], int]:
    """The byte offset of each tensor in a chunk and the chunk's size (see the module docstring)."""
    offsets, at = [], 0
    for shape, name in zip(shapes, dtype_names, strict=True):
        if name not in DTYPES:
            raise ValueError(f"weight transfer: dtype {name!r} is not one of {', '.join(DTYPES)}")
        if any(not isinstance(n, int) or n < 0 for n in shape):
            raise ValueError(f"weight transfer: shape {list(shape)} is not a list of sizes")
        offsets.append(at)
        at += -(-math.prod(shape) * getattr(torch, name).itemsize // ALIGN) * ALIGN
    return offsets, at


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The chunk of `tensors` as one CPU byte buffer, laid out by `chunk_layout`."""
    names = [str(t.dtype).removeprefix("torch.") for t in tensors]
    offsets, size = chunk_layout([list(t.shape) for t in tensors], names)
    buf = torch.zeros(size, dtype=torch.uint8)
    for t, at in zip(tensors, offsets):
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        buf[at : at + raw.numel()] = raw
    return buf


def unpack(
    buf: torch.Tensor, shapes: Sequence[Sequence[int]], dtype_names: Sequence[str]
) -> list[torch.Tensor]:
    """The tensors of a chunk received into `buf`: views of it, one per shape."""
    offsets, _ = chunk_layout(shapes, dtype_names)
    out = []
    for shape, name, at in zip(shapes, dtype_names, offsets):
        dtype = getattr(torch, name)
        n = math.prod(shape) * dtype.itemsize
        out.append(buf[at : at + n].view(dtype).view(list(shape)))
    return out


def open_group(host: str, port: int, rank: int, world: int, timeout_s: float) -> Any:
    """A gloo group of `world` processes whose TCP store rank 0 hosts at `host:port`, apart from any
    default process group (the trainer's ranks keep theirs)."""
    import torch.distributed as dist

    wait = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=wait)
    return dist.ProcessGroupGloo(dist.PrefixStore("treetrain-weights", store), rank, world, wait)


@dataclass(frozen=True)
class SentChunk:
    """What one `/update_weights` call carries."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooSender:
    """The trainer's end of one server's transfer group (see the module docstring).

    `host` is the address the server's workers reach the trainer at; the port is free on it."""

    def __init__(self, url: str, host: str = "127.0.0.1", timeout_s: float = TIMEOUT_S) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.sent_bytes = 0
        """Bytes broadcast to this server."""
        answer = call_server(url, "/get_world_size", None, timeout_s)
        workers = answer.get("world_size") if isinstance(answer, dict) else None
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
            raise EngineError(f"vllm-server {url}/get_world_size: not a worker count: {short(answer)}")
        try:
            port = _free_port(host)
        except OSError as exc:
            raise EngineError(
                f"rollout.vllm.transfer_host {host!r}: no port to listen on there ({exc})"
            ) from None
        info = dict(
            master_address=host, master_port=port, rank_offset=1, world_size=workers + 1, timeout_s=timeout_s
        )
        failed: list[BaseException] = []
        joined: list[Any] = []

        def join() -> None:
            try:
                joined.append(open_group(host, port, 0, workers + 1, timeout_s))
            except BaseException as exc:  # a rendezvous that timed out or could not listen
                failed.append(exc)

        # the server's workers connect to this store while the call is in flight: both sides wait for each
        # other, and a server that refuses the call must not leave this side waiting out the timeout
        opener = threading.Thread(target=join, daemon=True, name="treetrain-gloo-join")
        opener.start()
        caller = threading.Thread(
            target=self._call, args=("/init_weight_transfer_engine", {"init_info": info}, failed), daemon=True
        )
        caller.start()
        deadline = time.monotonic() + min(timeout_s, JOIN_S)
        while (opener.is_alive() or caller.is_alive()) and not failed and time.monotonic() < deadline:
            opener.join(0.05)
        if failed and isinstance(failed[0], EngineError):
            raise failed[0]
        if failed or not joined:
            why = short(failed[0]) if failed else f"its workers did not join in {min(timeout_s, JOIN_S):g} s"
            raise ServerLostError(
                f"vllm-server {url}: the weight transfer group did not form ({why}; do the servers reach "
                f"rollout.vllm.transfer_host {host!r}?)"
            )
        self.group = joined[0]

    def _call(self, path: str, body: dict[str, Any], failed: list[BaseException]) -> None:
        try:
            call_server(self.url, path, body, self.timeout_s)
        except BaseException as exc:  # surfaced by the caller, after its side of the collective
            failed.append(exc)

    def start(self) -> None:
        call_server(self.url, "/start_weight_update", {}, self.timeout_s)

    def chunk(self, chunk: SentChunk, buf: torch.Tensor) -> None:
        """One `/update_weights` call, answered by the broadcast of `buf` (the chunk's packed bytes). A call
        the server refuses ends the wait for the broadcast at once, with the server's answer."""
        failed: list[BaseException] = []
        body = {"update_info": chunk.__dict__}
        thread = threading.Thread(target=self._call, args=("/update_weights", body, failed), daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        try:
            work = self.group.broadcast(buf, 0)
            while not work.is_completed() and not failed and time.monotonic() < deadline:
                thread.join(0.01)
            if work.is_completed():
                work.wait()
        except RuntimeError as exc:  # the server's end of the group went away
            raise ServerLostError(
                f"vllm-server {self.url}: the weight broadcast failed: {short(exc)}"
            ) from None
        if not failed and work.is_completed():
            thread.join(max(0.0, deadline - time.monotonic()))
        if failed:
            why = failed[0]
            raise (
                why
                if isinstance(why, EngineError)
                else ServerLostError(f"vllm-server {self.url}: {short(why)}")
            )
        if not work.is_completed() or thread.is_alive():
            raise ServerLostError(
                f"vllm-server {self.url}: a weight chunk was not taken in {self.timeout_s:g} s"
            )
        self.sent_bytes += buf.numel()

    def finish(self) -> None:
        call_server(self.url, "/finish_weight_update", {}, self.timeout_s)

    def close(self) -> None:
        """Have the server drop its end of the group (it keeps serving), and drop this end."""
        with contextlib.suppress(EngineError):  # a lost server has nothing to shut down
            call_server(self.url, "/shutdown_weight_transfer_engine", {}, self.timeout_s)
        self.group = None


def stream(
    senders: dict[int, GlooSender], buckets: Iterable[list[tuple[str, torch.Tensor]]]
) -> dict[int, EngineError]:
    """Stream `buckets` into every server of `senders` as one weight update, each bucket packed once; the
    servers that failed, by key. `buckets` is consumed whole even when every server has failed: under ZeRO-3
    each bucket's gather is a collective that the other ranks run too."""
    failed: dict[int, EngineError] = {}

    def each(step: Callable[[GlooSender], None]) -> None:
        for key, sender in senders.items():
            if key not in failed:
                try:
                    step(sender)
                except EngineError as exc:
                    failed[key] = exc
                except Exception as exc:  # any other fault is this server's too: the stream goes on
                    failed[key] = EngineError(f"vllm-server {sender.url}: {type(exc).__name__}: {short(exc)}")

    each(GlooSender.start)
    for bucket in buckets:
        if len(failed) == len(senders):
            continue
        tensors = [t for _, t in bucket]
        try:
            buf = pack(tensors)
        except ValueError as exc:  # a tensor this wire does not carry: no server gets the version
            failed |= {key: EngineError(f"weight transfer: {exc}") for key in senders if key not in failed}
            continue
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
        chunk = SentChunk([n for n, _ in bucket], dtypes, [list(t.shape) for t in tensors])
        each(partial(GlooSender.chunk, chunk=chunk, buf=buf))
    each(GlooSender.finish)
    return failed


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
