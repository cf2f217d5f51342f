"""The requests a `VLLMServerEngine` holds, and the parts each is sent as.

A request is first sent whole, as one part. When its server is lost, each unfinished sample goes on from
what it drew (the tokens a streamed answer brought so far, with their sampler logprobs), as the scheduler
resumes samples interrupted for new weights: samples that drew the same tokens (nothing at all, mostly) go
on together, as one part whose context is the request's plus those tokens and whose budget is what is left;
a part that drew nothing is the request as it was, seed included. A sample's parts are joined back
(`generation.continued`: a stop sequence may span them), so the request is answered once, whole, as if
nothing had happened. A part whose tokens already end the sample (a stop, or the budget) needs no request.

`Ledger` holds no lock: the engine calls it under its own.

Example:
    >>> from treetrain.rollout.sampling import Sampling
    >>> ledger = Ledger()
    >>> part = ledger.open(0, GenerationRequest((5, 6), 1, 4, Sampling(), ((2,),)), version=1, adapter=None)
    >>> part.streamed.add({"choices": [{"index": 0, "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}}]})
    >>> (rest,) = ledger.lost(part.pid)
    >>> rest.request.context, rest.request.max_new_tokens, rest.draft.tokens
    ((5, 6, 7), 3, (7,))
    >>> ledger.answered(rest.pid, (Completion((2,), (-0.1,), "stop", 1),), cached=2)
    >>> ledger.take(0).completions
    (Completion(tokens=(7, 2), logprobs=(-0.5, -0.1), finish='stop', version=1, runs=()),)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from treetrain.rollout.engines.generation import (
    Completion,
    Draft,
    GenerationRequest,
    GenerationResult,
    Interrupted,
    StopMatcher,
    continued,
    cut_at_stop,
    finished,
)
from treetrain.rollout.engines.server_stream import StreamedAnswer


@dataclass
class Part:
    """One HTTP request of a held request: all its samples (`slots` every one, `draft` empty), or the rest of
    those that drew `draft` before their server was lost."""

    pid: int
    rid: int
    request: GenerationRequest
    """What is sent."""
    slots: tuple[int, ...]
    draft: Draft
    version: int
    adapter: str | None
    streamed: StreamedAnswer
    """Its answer as it streams in (unused for an answer read whole)."""
    server: int | None = None


@dataclass
class _Held:
    request: GenerationRequest
    samples: list[Completion | None]
    stops: StopMatcher
    cached: int = 0
    parts: set[int] = field(default_factory=set)


def part_seed(seed: int, slot: int, drawn: int) -> int:
    """The seed of the rest of sample `slot` of a request seeded `seed`, after `drawn` tokens (a function of
    the three, as the scheduler's seeds are)."""
    digest = hashlib.blake2b(repr((seed, slot, drawn)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


class Ledger:
    """The requests held (from `open` until `take`), their parts, and how the parts join; see the module
    docstring."""

    def __init__(self) -> None:
        self.held: dict[int, _Held] = {}
        self.parts: dict[int, Part] = {}
        self._next = 0

    def _part(self, rid: int, request: GenerationRequest, slots: tuple[int, ...], draft: Draft, like: Part | None,
              version: int = 0, adapter: str | None = None) -> Part:  # fmt: skip
        if like is not None:
            version, adapter = like.version, like.adapter
        part = Part(
            self._next, rid, request, slots, draft, version, adapter, StreamedAnswer(request, version)
        )
        self._next += 1
        self.parts[part.pid] = part
        self.held[rid].parts.add(part.pid)
        return part

    def open(self, rid: int, request: GenerationRequest, version: int, adapter: str | None) -> Part:
        """Hold request `rid`, sampled at `version` (with LoRA adapter `adapter`); its first part, whole."""
        self.held[rid] = _Held(request, [None] * request.n, StopMatcher.of(request.stop))
        return self._part(rid, request, tuple(range(request.n)), Draft(), None, version, adapter)

    def in_flight(self, servers: int) -> list[int]:
        """Samples in flight per server."""
        out = [0] * servers
        for part in self.parts.values():
            if part.server is not None:
                out[part.server] += part.request.n
        return out

    def on(self, server: int) -> list[int]:
        """The parts in flight on `server`."""
        return [p.pid for p in self.parts.values() if p.server == server]

    def answered(self, pid: int, completions: tuple[Completion, ...], cached: int) -> None:
        """Part `pid` came back with `completions`, one per slot (ignored when it is no longer held)."""
        part = self.parts.pop(pid, None)
        if part is None:
            return
        held = self.held[part.rid]
        held.parts.discard(pid)
        held.cached += cached
        for slot, completion in zip(part.slots, completions, strict=True):
            held.samples[slot] = continued(part.draft, completion, held.stops)

    def lost(self, pid: int) -> list[Part]:
        """Part `pid`'s server was lost: what each of its samples drew is kept, and the parts that go on
        from there are returned (none when every sample had ended)."""
        part = self.parts.pop(pid, None)
        if part is None:
            return []
        held = self.held[part.rid]
        held.parts.discard(pid)
        same: dict[Draft, list[int]] = {}
        for slot, sample in zip(part.slots, part.streamed.samples(), strict=True):
            if isinstance(sample, Completion):
                held.samples[slot] = continued(part.draft, sample, held.stops)
                continue
            drawn = part.draft.then(sample.tokens, sample.logprobs, sample.runs)
            left = held.request.max_new_tokens - len(drawn.tokens)
            if left < 1 or cut_at_stop(drawn.tokens, held.stops) is not None:
                held.samples[slot] = finished(drawn, held.stops, "length")
            else:
                same.setdefault(drawn, []).append(slot)
        rest = []
        for drawn, slots in same.items():
            request = held.request
            if drawn.tokens:
                request = GenerationRequest(
                    context=(*request.context, *drawn.tokens), n=len(slots),
                    max_new_tokens=request.max_new_tokens - len(drawn.tokens), sampling=request.sampling,
                    stop=request.stop, group=request.group, children=request.children,
                    seed=part_seed(request.seed, slots[0], len(drawn.tokens)),
                )  # fmt: skip
            elif len(slots) != request.n:
                request = GenerationRequest(
                    context=request.context, n=len(slots), max_new_tokens=request.max_new_tokens,
                    sampling=request.sampling, stop=request.stop, group=request.group,
                    children=request.children, seed=part_seed(request.seed, slots[0], 0),
                )  # fmt: skip
            rest.append(self._part(part.rid, request, tuple(slots), drawn, part))
        return rest

    def complete(self, rid: int) -> bool:
        held = self.held.get(rid)
        return held is not None and not held.parts and all(s is not None for s in held.samples)

    def take(self, rid: int) -> GenerationResult:
        """The answer of a `complete` request, which is no longer held."""
        held = self.held.pop(rid)
        samples = tuple(s for s in held.samples if s is not None)
        return GenerationResult(rid, samples, held.cached)

    def drop(self, rid: int) -> None:
        """Forget request `rid` and its parts (it failed)."""
        held = self.held.pop(rid, None)
        for pid in held.parts if held is not None else ():
            self.parts.pop(pid, None)

    def interrupt(self) -> list[Interrupted]:
        """Every held request, per sample its completion or what it drew so far; nothing is held afterwards."""
        out = []
        for rid in sorted(self.held):
            held = self.held[rid]
            samples: list[Completion | Draft] = [s if s is not None else Draft() for s in held.samples]
            for pid in held.parts:
                part = self.parts[pid]
                for slot, sample in zip(part.slots, part.streamed.samples(), strict=True):
                    if isinstance(sample, Completion):
                        samples[slot] = continued(part.draft, sample, held.stops)
                    else:
                        samples[slot] = part.draft.then(sample.tokens, sample.logprobs, sample.runs)
            out.append(Interrupted(rid, tuple(samples)))
        self.clear()
        return out

    def clear(self) -> None:
        self.held.clear()
        self.parts.clear()
