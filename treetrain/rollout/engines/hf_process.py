"""The `hf` engine in a process of its own, so that sampling and training each keep a core busy.

In an asynchronous run (`rollout.max_staleness` >= 1) the sampler grows trees while the trainer steps. An
`HFEngine` on a thread of the trainer's process shares the interpreter lock with training; `HFProcessEngine`
runs it in a child process instead (`torch.multiprocessing`, spawn). The child builds a private copy of the
policy and an `HFEngine` over it, and decodes step after step on its own while it has requests, sending
each `GenerationResult` back as it finishes. The parent only forwards commands and collects answers.

**Weights by version.** The engine is built over the `WeightFeed`'s shadow, which lives in shared memory
(`WeightFeed(..., shared=True)`, in `/dev/shm`) and travels to the child once, at start. A sync (`sync_weights(shadow,
version)`, which `WeightFeed.sync` calls holding the feed's lock) tells the child to copy the shadow into its
private model and blocks until the child says it has: a publish never rewrites the shadow while the child
reads it, and the child never samples from the shadow, so a request in flight is never sampled by a model
that changes under it.

**Lifetime.** The child dies with its parent: it asks Linux for SIGKILL when the parent thread that started
it ends (`PR_SET_PDEATHSIG`, so start it on a thread that lives as long as it, as the trainer's main thread
does), and it exits when its command pipe reports end of file. A child that raises or dies gives the
parent a one-line `EngineError` naming the cause. Start-up (spawn, imports, the model copy: 3.3-3.5 s on the
demo model, nearly all of it imports) runs while the parent goes on; the first command that needs an answer
waits for it (`startup_seconds`). The process may be spawned earlier, before the policy exists
(`treetrain.rollout.engines.sampler_process.SamplerProcess`, given as `process`): its imports then run while
the trainer loads, and the engine only sends it the shadow.

**Threads.** The child runs `threads` torch threads; None gives 1: the sampler's decode steps of a small
model gain little from a second thread, and on a 2-core machine the trainer keeps the other core.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from treetrain.rollout.engines.generation import GenerationRequest
    >>> from treetrain.rollout.sampling import Sampling
    >>> from treetrain.rollout.weight_feed import WeightFeed
    >>> _ = torch.manual_seed(0)
    >>> policy = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
    >>> feed = WeightFeed(policy, version=0, shared=True)
    >>> engine = HFProcessEngine(feed.shadow)
    >>> feed.sync(engine)
    >>> rid = engine.submit(GenerationRequest((5, 6, 7), 2, 4, Sampling(), ((1,),), seed=0))
    >>> done = []
    >>> while engine.busy:
    ...     done += engine.poll()
    >>> [(r.request_id, len(r.completions), r.completions[0].version) for r in done]
    [(0, 2, 0)]
    >>> engine.close()
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any, NoReturn

import torch.multiprocessing  # noqa: F401  # its tensor pickling sends the shadow as shared memory

from treetrain.rollout.engines.generation import (
    EngineError,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    Interrupted,
)
from treetrain.rollout.engines.hf_child import (
    Abort,
    ChildSettings,
    Close,
    Command,
    Failed,
    Finished,
    Interrupt,
    Ready,
    ReleaseGroup,
    Reply,
    Start,
    Stopped,
    Submit,
    Sync,
    Synced,
    one_line,
)
from treetrain.rollout.engines.sampler_process import PROCESS_NAME, SamplerProcess
from treetrain.rollout.weight_feed import share_memory

__all__ = ["PROCESS_NAME", "HFProcessEngine"]

POLL_WAIT_S = 0.002
"""Longest `poll` waits for an answer when none arrived. The scheduler notices finished tool calls only
between polls, so a long wait delays the branch points they make ready: on the demo, 20 ms left the
asynchronous update loop about 1.3x slower than 2 ms."""
REPLY_TIMEOUT_S = 600.0
"""Longest wait for the child's answer to a command (start-up included) before the engine gives up."""


class HFProcessEngine:
    """An `HFEngine` in a child process over a private copy of `shadow`; see the module docstring.

    `shadow` is the model every sync copies from (the feed's shadow); it is moved to shared memory if it
    is not there yet. The engine starts as weight version `version`, sampling the shadow's weights as they
    are at start (the factory's -1 says: sync before the first request)."""

    def __init__(
        self,
        shadow: Any,
        *,
        version: int = -1,
        threads: int | None = None,
        max_kv_bytes: int | None = None,
        process: SamplerProcess | None = None,
    ) -> None:
        """`process`: a sampler process spawned earlier, whose imports ran meanwhile (None: spawn one now)."""
        if threads is not None and threads < 1:
            raise EngineError(f"rollout.engine=hf: the sampler process needs >= 1 thread, got {threads}")
        self.version = version
        self.stats = EngineStats()
        self.startup_seconds: float | None = None
        """Spawn, imports and the model copy, from the start of the process to its first answer."""
        self.child_threads: int | None = None
        """The torch threads the child runs (known once it answered)."""
        self._shadow = share_memory(shadow)
        self._next_id = 0
        self._outstanding: set[int] = set()
        self._done: list[GenerationResult] = []
        self._broken: str | None = None
        self._closed = False
        self._process = process if process is not None else SamplerProcess()
        self._process.adopt()
        self._commands, self._replies = self._process.commands, self._process.replies
        self._proc = self._process.proc
        self._started = self._process.started
        try:  # the shadow's tensors travel as shared memory, not as copies
            self._commands.send(Start(self._shadow, ChildSettings(threads or 1, max_kv_bytes, version)))
        except Exception as exc:  # the model does not pickle, or the process is gone
            self._process.stop()
            self._closed = True
            raise EngineError(
                f"rollout.engine=hf: the sampler process did not start: {one_line(exc)}"
            ) from None

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # ----- GenerationEngine -------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> int:
        rid = self._next_id
        self._next_id += 1
        self._send(Submit(rid, request))
        self._outstanding.add(rid)
        return rid

    def poll(self) -> list[GenerationResult]:
        """The results that arrived, waiting up to `POLL_WAIT_S` when none has."""
        self._check()
        if not self._done and self._outstanding:
            self._receive(POLL_WAIT_S)
        while self._replies.poll(0):
            self._receive(0)
        done, self._done = self._done, []
        return done

    @property
    def busy(self) -> bool:
        return bool(self._outstanding or self._done)

    def sync_weights(self, model: object, version: int) -> None:
        """Have the child copy `model` (the shared shadow) into its own model as `version`; returns once it
        has, so the caller may let the shadow be rewritten."""
        if self.busy:
            raise EngineError(
                "rollout.engine=hf: sync_weights while requests are in flight (abort them first)"
            )
        if model is not self._shadow:
            raise EngineError(
                "rollout.engine=hf: the sampler process copies weights from the shared shadow it was started "
                f"with, not from another model ({type(model).__name__})"
            )
        self._send(Sync(version))
        self._await(Synced)
        self.version = version

    def release_group(self, group: str) -> None:
        self._send(ReleaseGroup(group))

    def abort(self) -> None:
        """Drop every request in flight; their answers still in the pipe are discarded as they arrive."""
        self._outstanding.clear()
        self._done.clear()
        if self._broken is None:
            self._send(Abort())

    def interrupt(self) -> list[Interrupted]:
        """The child engine's `interrupt()`, under this engine's request ids, with the requests that had
        finished but were still on their way folded in as `Interrupted(request_id, completions)`; the engine
        is idle afterwards."""
        self._send(Interrupt())
        answer = self._await(Stopped)
        arrived = [Interrupted(r.request_id, r.completions) for r in self._done]
        self._outstanding.clear()
        self._done.clear()
        return sorted([*answer.stopped, *arrived], key=lambda i: i.request_id)

    def close(self) -> None:
        """Ask the child to exit, then make sure it has."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None:
            with contextlib.suppress(OSError):  # it died meanwhile: the join below sees it
                self._commands.send(Close())
        self._process.stop()
        self._outstanding.clear()
        self._done.clear()
        if self._broken is None:
            self._broken = "the sampler process was closed"

    # ----- the pipe ---------------------------------------------------------------------------------
    def _send(self, command: Command) -> None:
        self._check()
        try:
            self._commands.send(command)
            return
        except OSError:
            pass
        self._fail(self._ended())

    def _await(self, kind: type[Any]) -> Any:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            reply = self._receive(max(deadline - time.monotonic(), 0.0))
            if isinstance(reply, kind):
                return reply
            if reply is None and time.monotonic() >= deadline:
                self._fail(f"the sampler process did not answer within {REPLY_TIMEOUT_S:.0f} s")

    def _receive(self, timeout: float) -> Reply | None:
        """One reply (taken into account), or None when none arrived within `timeout` seconds."""
        self._check()
        end = time.monotonic() + timeout
        while not self._replies.poll(min(max(end - time.monotonic(), 0.0), 0.5)):
            if not self._proc.is_alive():
                self._fail(self._ended())
            if time.monotonic() >= end:
                return None
        try:
            reply: Reply = self._replies.recv()
        except (EOFError, OSError):
            reply = Failed(self._ended())
        if isinstance(reply, Failed):
            self._fail(reply.line)
        if isinstance(reply, Ready):
            self.startup_seconds, self.child_threads = reply.at - self._started, reply.threads
        elif isinstance(reply, Finished):
            self.stats = reply.stats
            for result in reply.results:
                if result.request_id in self._outstanding:  # not aborted meanwhile
                    self._outstanding.discard(result.request_id)
                    self._done.append(result)
        elif isinstance(reply, (Synced, Stopped)):
            self.stats = reply.stats
        return reply

    def _ended(self) -> str:
        self._proc.join(5.0)
        code = self._proc.exitcode
        if code is not None and code < 0:
            return f"the sampler process was killed by {signal.Signals(-code).name}"
        return f"the sampler process exited (status {code})"

    def _check(self) -> None:
        if self._broken is not None:
            raise EngineError(f"rollout.engine=hf: {self._broken}")

    def _fail(self, line: str) -> NoReturn:
        self._broken = line
        if self._proc.is_alive():
            self._proc.kill()
        raise EngineError(f"rollout.engine=hf: {line}")
