"""A `/v1/completions` answer: streamed, its server-sent events read as they come, and the samples they make;
whole or streamed, the completions it holds (`parse_completions`).

With weights that change while requests are in flight, `VLLMServerEngine` asks for `stream: true`, so that
it knows each sample's tokens before the answer ends: `StreamedAnswer` keeps them, `interrupt` turns them
into `Draft`s, and `stream_server` stops reading (closing the connection, which makes vLLM abort the
request) once the engine no longer wants it. The stream is bounded like one answer and fails in one line.

Example:
    >>> from treetrain.rollout.sampling import Sampling
    >>> answer = StreamedAnswer(GenerationRequest((5, 6), 1, 4, Sampling(), ((2,),)), version=3)
    >>> answer.add({"choices": [{"index": 0, "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}}]})
    >>> answer.samples()
    (Draft(tokens=(7,), logprobs=(-0.5,), runs=((1, 3),)),)
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any, NamedTuple

from treetrain.rollout.engines.generation import (
    Completion,
    Draft,
    EngineError,
    GenerationRequest,
    StopMatcher,
    completion_of,
)
from treetrain.rollout.engines.server_calls import (
    MAX_RESPONSE_BYTES,
    ServerLostError,
    call_errors,
    request_of,
    short,
)


def stream_server(
    url: str, path: str, body: dict[str, Any], timeout: float, on_event: Callable[[Any], bool]
) -> bool:
    """POST `body` to `url + path` and read its server-sent events, handing each parsed `data:` payload to
    `on_event` until `[DONE]` (True) or until `on_event` returns False (False): the connection is then
    closed, which makes vLLM abort the request. The whole stream is bounded like one answer."""
    read = 0
    with (
        call_errors(url, path, timeout),
        urllib.request.urlopen(request_of(url, path, body), timeout=timeout) as resp,
    ):
        while True:
            line = resp.readline(MAX_RESPONSE_BYTES + 1)
            read += len(line)
            if not line:
                raise ServerLostError(f"vllm-server {url}{path}: the stream ended before [DONE]")
            if read > MAX_RESPONSE_BYTES:
                raise EngineError(f"vllm-server {url}{path}: a stream over {MAX_RESPONSE_BYTES} bytes")
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return True
            try:
                event = json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise EngineError(
                    f"vllm-server {url}{path}: an event is not JSON ({exc}): {short(data[:200])}"
                ) from None
            if not on_event(event):
                return False


class StreamedAnswer:
    """A streamed request's samples as its events arrive: per sample the token ids, their logprobs and the
    finish reason (set by its last event), and the usage the final event reports."""

    def __init__(self, request: GenerationRequest, version: int) -> None:
        self.request, self.version = request, version
        self.tokens: list[list[int]] = [[] for _ in range(request.n)]
        self.logprobs: list[list[float]] = [[] for _ in range(request.n)]
        self.finish: list[str | None] = [None] * request.n
        self.usage: Any = None

    def add(self, event: Any) -> None:
        """One event: a `KeyError`, `TypeError` or `ValueError` when it is outside the protocol."""
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            i = int(choice["index"])
            if not 0 <= i < self.request.n:
                raise ValueError(f"sample index {i} of a request of n={self.request.n}")
            ids, lps = (
                choice.get("token_ids") or [],
                (choice.get("logprobs") or {}).get("token_logprobs") or [],
            )
            if len(ids) != len(lps):
                raise ValueError(f"{len(ids)} token ids but {len(lps)} logprobs in one event")
            self.tokens[i] += [int(t) for t in ids]
            self.logprobs[i] += [float(x) for x in lps]
            self.finish[i] = choice.get("finish_reason") or self.finish[i]

    def answer(self) -> dict[str, Any]:
        """The whole answer, shaped as the unstreamed `/v1/completions` one (for `VLLMServerEngine._parse`)."""
        choices = [
            {"index": i, "token_ids": t, "logprobs": {"token_logprobs": lp}, "finish_reason": f}
            for i, (t, lp, f) in enumerate(zip(self.tokens, self.logprobs, self.finish))
        ]
        return {"choices": choices, "usage": self.usage or {}}

    def samples(self) -> tuple[Completion | Draft, ...]:
        """Each sample as `interrupt` returns it: a `Completion` when it ended, else the `Draft` so far."""
        stops = StopMatcher.of(self.request.stop)
        return tuple(
            completion_of(t, lp, f, stops, self.version)
            if f is not None and t
            else Draft.drawn(t, lp, self.version)
            for t, lp, f in zip(self.tokens, self.logprobs, self.finish)
        )


class Parsed(NamedTuple):
    """A completions answer's samples and the prompt tokens the server had cached."""

    completions: tuple[Completion, ...]
    cached: int


def parse_completions(where: str, answer: Any, request: GenerationRequest, version: int) -> Parsed:
    """The `request.n` samples of a whole `/v1/completions` answer (or `StreamedAnswer.answer()`), each cut at
    its first stop; anything outside the protocol is one `EngineError` line starting with `where`."""
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
    return Parsed(tuple(completions), cached)
