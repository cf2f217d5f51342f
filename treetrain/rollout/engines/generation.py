"""One interface to every inference engine: token ids in, token ids and their logprobs out.

A branch point of a tree is one `GenerationRequest`: the context's token ids (the node's token path), how
many samples to draw, the sampling settings, and the stop sequences. The engine answers with one
`GenerationResult`: for each sample, the sampled ids, the logprob of each under the distribution it was
drawn from, why it ended, and the weight version that produced it. The tree is grown from exactly these ids:
nothing is re-rendered or re-tokenized, so the trainer sees exactly what was sampled.

Engines are asynchronous in one simple way: `submit` queues a request and returns its id at once, and
`poll` advances the engine (one batched decode step for the in-process engines, a wait on the network for a
server) and returns the requests that finished meanwhile. A scheduler keeps every ready branch point of
every tree submitted, so the engine always sees all the work there is.

Engines: `HFEngine` (`treetrain.rollout.engines.hf_engine`, the model being trained, continuous batching over every
in-flight row), `VLLMEngine` (`treetrain.rollout.engines.vllm_engine`, vLLM in this process) and `VLLMServerEngine`
(`treetrain.rollout.engines.vllm_server`, `vllm serve` processes over HTTP). This module imports no torch.

Example:
    >>> from treetrain.rollout.sampling import Sampling
    >>> r = GenerationRequest((5, 6, 7), n=2, max_new_tokens=4, sampling=Sampling(), stop=((1,),), seed=3)
    >>> r.prompt_tokens, r.stop_ids, r.stop_sequences
    (3, (1,), ())
    >>> c = Completion((9, 1), (-0.5, -0.1), "stop", version=2)
    >>> c.stopped
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from treetrain.errors import TreetrainError
from treetrain.rollout.sampling import Sampling

FinishReason = Literal["stop", "length"]


class EngineError(TreetrainError, RuntimeError):
    """An inference engine that cannot serve: a server that is down, slow or answers out of protocol, or an
    engine that cannot load the model. The message is one line naming the engine (and URL) and the cause."""


class VersionMismatchError(EngineError):
    """The engine sampled with weights other than the trainer's current ones: training on those samples
    would be a silent off-policy update, so the rollout stops instead."""


@dataclass(frozen=True)
class GenerationRequest:
    """`n` continuations of one context: one branch point of a tree."""

    context: tuple[int, ...]
    """Token ids the samples continue: the node's whole token path (prompt, turns, observations)."""
    n: int
    """How many samples to draw from this context (the branch point's policy fan-out)."""
    max_new_tokens: int
    """Most tokens one sample may have (the turn budget left to the episode)."""
    sampling: Sampling
    """Temperature and top-p."""
    stop: tuple[tuple[int, ...], ...]
    """Token sequences that end a sample (single ids are 1-tuples); the stop tokens are kept in the sample."""
    seed: int = 0
    """Seed of this request's samples: the same request with the same seed draws the same tokens on one
    engine, whatever else is in flight."""
    group: str = ""
    """Routing key (the tree's task): a group's requests stay on one server while it has room, so that its
    prefix cache holds the tree (`server_fleet`)."""
    children: int = 1
    """How many later requests are expected to extend each sample (the environment fan-out): a hint for an
    engine that keeps sampled prefixes for reuse; engines with their own prefix cache ignore it."""

    def __post_init__(self) -> None:
        if not self.context:
            raise ValueError("a generation request needs at least one context token")
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got {self.n}, {self.max_new_tokens}")
        if not self.stop or not all(self.stop):
            raise ValueError("a generation request needs stop sequences, none of them empty")

    @property
    def prompt_tokens(self) -> int:
        return len(self.context)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The single-token stops."""
        return tuple(s[0] for s in self.stop if len(s) == 1)

    @property
    def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
        """The stops of more than one token."""
        return tuple(s for s in self.stop if len(s) > 1)


@dataclass(frozen=True)
class Completion:
    """One sample of a request."""

    tokens: tuple[int, ...]
    """The sampled ids, ending with the stop sequence when `finish == "stop"`."""
    logprobs: tuple[float, ...]
    """Logprob of each sampled id under the distribution it was drawn from (0 under greedy decoding)."""
    finish: FinishReason
    """`stop`: a stop sequence ended it; `length`: `max_new_tokens` cut it."""
    version: int
    """The weight version that sampled it (`GenerationEngine.version` when it was drawn); of a sample whose
    request was interrupted for new weights, the version of its last token."""
    runs: tuple[tuple[int, int], ...] = ()
    """`(tokens, version)` runs in sample order when the sample spans weight versions (`continued`); empty
    when every token is of `version`."""

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.logprobs):
            raise ValueError(f"a completion needs one logprob per token, got {len(self.tokens)} tokens")
        if self.runs and (
            sum(n for n, _ in self.runs) != len(self.tokens) or self.runs[-1][1] != self.version
        ):
            raise ValueError(
                f"version runs {self.runs} do not cover {len(self.tokens)} tokens ending at {self.version}"
            )

    @property
    def stopped(self) -> bool:
        return self.finish == "stop"

    @property
    def version_runs(self) -> tuple[tuple[int, int], ...]:
        """`(tokens, version)` runs covering every token, in sample order."""
        return self.runs or ((len(self.tokens), self.version),)


@dataclass(frozen=True)
class Draft:
    """What one unfinished sample had drawn when its request was interrupted (possibly nothing yet)."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    runs: tuple[tuple[int, int], ...] = ()
    """`(tokens, version)` runs of `tokens`, as `Completion.runs` (empty when there are no tokens)."""

    @staticmethod
    def drawn(tokens: Sequence[int], logprobs: Sequence[float], version: int) -> Draft:
        """The tokens one sample drew under `version` before it was stopped."""
        tokens, logprobs = tuple(int(t) for t in tokens), tuple(min(float(x), 0.0) for x in logprobs)
        return Draft(tokens, logprobs, ((len(tokens), version),) if tokens else ())

    def then(
        self, tokens: Sequence[int], logprobs: Sequence[float], runs: Sequence[tuple[int, int]]
    ) -> Draft:
        """This draft followed by more tokens and their runs (neighbouring runs of one version merge)."""
        merged = list(self.runs)
        for n, v in runs:
            if merged and merged[-1][1] == v:
                merged[-1] = (merged[-1][0] + n, v)
            elif n:
                merged.append((n, v))
        return Draft((*self.tokens, *tokens), (*self.logprobs, *logprobs), tuple(merged))


@dataclass(frozen=True)
class Interrupted:
    """A request stopped by `GenerationEngine.interrupt`: per sample, its completion when it had finished,
    else what it had drawn so far."""

    request_id: int
    samples: tuple[Completion | Draft, ...]


def finished(draft: Draft, stops: StopMatcher, finish: FinishReason) -> Completion:
    """`draft` as a completion: cut at its first stop (finish `stop`), else ended by `finish`."""
    if not draft.tokens or len(draft.tokens) != len(draft.logprobs):
        raise ValueError(f"a completion needs one logprob per token, got {len(draft.tokens)} tokens")
    end = cut_at_stop(draft.tokens, stops)
    if end is not None:
        finish = "stop"
    end = len(draft.tokens) if end is None else end
    runs, left = [], end
    for n, v in draft.runs:
        if left > 0:
            runs.append((min(n, left), v))
            left -= n
    one = len(runs) == 1
    return Completion(
        draft.tokens[:end], draft.logprobs[:end], finish, runs[-1][1], () if one else tuple(runs)
    )


def continued(draft: Draft, completion: Completion, stops: StopMatcher) -> Completion:
    """The sample `draft` began, finished by `completion` (its continuation under newer weights), cut at the
    first stop (one may span the two parts).

    >>> head = Draft.drawn((4, 7), (-0.5, -0.25), version=0)
    >>> whole = continued(head, Completion((8, 9), (-0.1, -0.2), "length", version=1), StopMatcher.of(((7, 8),)))
    >>> whole.tokens, whole.finish, whole.version_runs
    ((4, 7, 8), 'stop', ((2, 0), (1, 1)))
    """
    joined = draft.then(completion.tokens, completion.logprobs, completion.version_runs)
    return finished(joined, stops, completion.finish)


@dataclass(frozen=True)
class GenerationResult:
    """The answer to one request: its `n` completions, in sample order."""

    request_id: int
    completions: tuple[Completion, ...]
    cached_tokens: int = 0
    """Context tokens the engine did not have to encode (served from its prefix cache)."""


@dataclass(frozen=True)
class ServerStats:
    """One `vllm serve` process's share of the work (`vllm-server` with several servers)."""

    url: str
    requests: int = 0
    """Requests sent to it (a lost server's resubmitted ones count again where they went)."""
    samples: int = 0
    """Samples those requests asked for."""
    queue_seconds: float = 0.0
    """Seconds requests waited in its queue, as its metrics say (every client's requests, not only ours)."""
    queued: int = 0
    """Requests those seconds are summed over."""

    def row(self) -> tuple[str, int, int, float]:
        """`(url, requests, samples, mean seconds queued)`, as `metrics.jsonl` records it."""
        return (
            self.url,
            self.requests,
            self.samples,
            self.queue_seconds / self.queued if self.queued else 0.0,
        )

    def minus(self, before: ServerStats) -> ServerStats:
        return ServerStats(
            self.url, self.requests - before.requests, self.samples - before.samples,
            self.queue_seconds - before.queue_seconds, self.queued - before.queued,
        )  # fmt: skip


@dataclass
class EngineStats:
    """Work done so far, for logs, tests and benchmarks."""

    requests: int = 0
    prompt_tokens: int = 0
    """Context tokens of every request."""
    cached_tokens: int = 0
    """Of those, the ones served from a prefix cache instead of encoded."""
    encoded_tokens: int = 0
    """Token positions run through the model for live rows, padding left out (the `hf` engine)."""
    forward_calls: int = 0
    sampled_tokens: int = 0
    weight_syncs: int = 0
    sync_seconds: float = 0.0
    sync_bytes: int = 0
    """Bytes sent to the engine by the weight syncs (full weights, or a LoRA adapter's files)."""
    servers_lost: int = 0
    """`vllm-server`: servers that stopped answering (their requests went on elsewhere)."""
    servers: tuple[ServerStats, ...] = ()
    """`vllm-server`: each server's share of the work."""

    def since(self, before: EngineStats) -> EngineStats:
        """The work done after `before` was copied."""
        earlier = {s.url: s for s in before.servers}
        return EngineStats(
            **{k: getattr(self, k) - getattr(before, k) for k in vars(self) if k != "servers"},
            servers=tuple(s.minus(earlier.get(s.url, ServerStats(s.url))) for s in self.servers),
        )

    def with_syncs(self, synced: EngineStats) -> EngineStats:
        """This work with the weight syncs of `synced` added (the sync before a rollout, which the rollout's
        own count does not see)."""
        return replace(
            self, weight_syncs=self.weight_syncs + synced.weight_syncs,
            sync_seconds=self.sync_seconds + synced.sync_seconds, sync_bytes=self.sync_bytes + synced.sync_bytes,
        )  # fmt: skip

    @property
    def cache_hit_rate(self) -> float:
        """Fraction of context tokens served from the prefix cache (0 when nothing was asked)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class GenerationEngine(Protocol):
    """What the scheduler needs from an engine; see the module docstring."""

    version: int
    """The weight version the engine samples with."""
    stats: EngineStats

    def submit(self, request: GenerationRequest) -> int:
        """Queue `request`; returns its id (unique for the engine's life)."""
        ...

    def poll(self) -> list[GenerationResult]:
        """Advance the engine and return the requests that finished (possibly none). Call while `busy`."""
        ...

    @property
    def busy(self) -> bool:
        """True while a submitted request has not been returned by `poll`."""
        ...

    def sync_weights(self, model: object, version: int) -> None:
        """Sample from `model`'s current weights from now on, as weight version `version`; an `EngineError`
        while requests are in flight (`abort` them first) or when the weights cannot be loaded."""
        ...

    def release_group(self, group: str) -> None:
        """The tree of `group` is finished: drop what the engine kept for it (engines with their own prefix
        cache keep nothing per group)."""
        ...

    def abort(self) -> None:
        """Drop every request in flight (a rollout that stopped early): the engine is idle afterwards, so
        `sync_weights` and the next rollout work; answers still on their way are discarded."""
        ...

    def interrupt(self) -> list[Interrupted] | None:
        """Stop every request in flight and say what each sample drew so far, so it can go on under new
        weights (the engine is idle afterwards, as after `abort`); None, with nothing stopped, from an engine
        that cannot see a request's tokens before it ends."""
        ...

    def close(self) -> None:
        """Free the engine's resources (processes, memory); it is unusable afterwards."""
        ...


def check_versions(results: Sequence[GenerationResult], expected: int, engine: str) -> None:
    """Refuse samples drawn with any weights but version `expected` (a `VersionMismatchError`).

    >>> ok = GenerationResult(0, (Completion((3,), (0.0,), "length", version=4),))
    >>> check_versions([ok], 4, "hf")
    >>> check_versions([ok], 5, "hf")
    Traceback (most recent call last):
    ...
    treetrain.rollout.engines.generation.VersionMismatchError: hf sampled request 0 with weight version 4, but the trainer is at version 5; refusing an off-policy update
    """
    for result in results:
        for c in result.completions:
            if c.version != expected:
                raise VersionMismatchError(
                    f"{engine} sampled request {result.request_id} with weight version {c.version}, but the "
                    f"trainer is at version {expected}; refusing an off-policy update"
                )


@dataclass(frozen=True)
class StopMatcher:
    """Whether a growing sample has just ended with one of a request's stop sequences.

    >>> m = StopMatcher.of(((2,), (7, 8)))
    >>> m.stops([5, 2]), m.stops([7, 8]), m.stops([8, 7])
    (True, True, False)
    """

    ids: frozenset[int] = field(default_factory=frozenset)
    sequences: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, stop: Sequence[Sequence[int]]) -> StopMatcher:
        return cls(frozenset(s[0] for s in stop if len(s) == 1), tuple(tuple(s) for s in stop if len(s) > 1))

    def stops(self, tokens: Sequence[int]) -> bool:
        if tokens and tokens[-1] in self.ids:
            return True
        return any(len(tokens) >= len(s) and tuple(tokens[-len(s) :]) == s for s in self.sequences)


def cut_at_stop(tokens: tuple[int, ...], stops: StopMatcher) -> int | None:
    """The length of `tokens` up to and including the first stop, or None when no stop occurs.

    >>> cut_at_stop((4, 7, 8, 9), StopMatcher.of(((7, 8),)))
    3
    """
    longest = max((len(s) for s in stops.sequences), default=1)
    for end in range(1, len(tokens) + 1):
        if stops.stops(tokens[max(0, end - longest) : end]):
            return end
    return None


def completion_of(
    token_ids: Iterable[int], logprobs: list[float], finish: str | None, stops: StopMatcher, version: int
) -> Completion:
    """A `Completion` from what an engine returned, cut at the first stop sequence."""
    drawn = Draft.drawn(tuple(token_ids), logprobs, version)
    return finished(drawn, stops, "stop" if finish == "stop" else "length")
