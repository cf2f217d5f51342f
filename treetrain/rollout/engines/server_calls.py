"""One JSON call to a `vllm serve` process, bounded in time and size, failing in one line.

Every way a call can go wrong (the server is down, answers with an HTTP error status, stays silent past
the timeout, resets the connection, answers something that is not JSON, or too much of it) becomes one
`EngineError` line naming the URL, the path and the fault. An error status is a `ServerHTTPError` that
carries its code, so a caller can tell an endpoint the server does not have (404) from a failure; a server
that cannot be reached or falls silent is a `ServerLostError`, which the engine routes around
(`treetrain.rollout.engines.server_fleet`) instead of stopping.

Example:
    >>> short("an   answer\\nover two lines", limit=16)
    'an answer ove...'
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from treetrain.rollout.engines.generation import EngineError

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 64 * 2**20
"""Largest answer read from a server."""


class ServerHTTPError(EngineError):
    """A server answered with an HTTP error status (`code`)."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


class ServerLostError(EngineError):
    """A server that did not answer: refused or dropped the connection, stayed silent past the timeout, or
    ended a stream before its last event (a server killed mid-answer)."""


def short(text: object, limit: int = 160) -> str:
    """`text` on one line, cut to `limit` characters."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def request_of(url: str, path: str, body: dict[str, Any] | None) -> urllib.request.Request:
    """The HTTP request of a call: `body` POSTed as JSON, or a GET when it is None."""
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.Request(
        url + path,
        data=data,
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )


@contextlib.contextmanager
def call_errors(url: str, path: str, timeout: float) -> Iterator[None]:
    """Every way a call can fail, as one `EngineError` line naming the URL and the cause."""
    try:
        yield
    except urllib.error.HTTPError as exc:
        detail = short(exc.read(2000).decode("utf-8", "replace")) if exc.fp else ""
        raise ServerHTTPError(
            f"vllm-server {url}{path}: HTTP {exc.code} {exc.reason}: {detail}", exc.code
        ) from None
    except urllib.error.URLError as exc:
        raise ServerLostError(f"vllm-server {url}{path}: cannot connect: {short(exc.reason)}") from None
    except TimeoutError:
        raise ServerLostError(f"vllm-server {url}{path}: no answer within {timeout:g}s") from None
    except (OSError, http.client.HTTPException) as exc:  # a reset, a bad status line, a short read
        raise ServerLostError(f"vllm-server {url}{path}: {type(exc).__name__}: {short(exc)}") from None
    except ValueError as exc:
        raise EngineError(f"vllm-server {url}{path}: {type(exc).__name__}: {short(exc)}") from None


def call_server(url: str, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
    """POST `body` (GET when None) to `url + path`; the parsed JSON answer (None for an empty one)."""
    with (
        call_errors(url, path, timeout),
        urllib.request.urlopen(request_of(url, path, body), timeout=timeout) as resp,
    ):
        raw = resp.read(MAX_RESPONSE_BYTES + 1)
    if len(raw) > MAX_RESPONSE_BYTES:
        raise EngineError(f"vllm-server {url}{path}: an answer over {MAX_RESPONSE_BYTES} bytes")
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(
            f"vllm-server {url}{path}: the answer is not JSON ({exc}): {short(raw[:200])}"
        ) from None


def fetch_text(url: str, path: str, timeout: float, limit: int) -> str | None:
    """GET `url + path` as text of at most `limit` bytes (None when longer: it is not read further)."""
    with (
        call_errors(url, path, timeout),
        urllib.request.urlopen(request_of(url, path, None), timeout=timeout) as resp,
    ):
        raw = resp.read(limit + 1)
    return None if len(raw) > limit else raw.decode("utf-8", "replace")


PROBE_TIMEOUT = 3.0
"""Seconds the start-up probe waits for each server: a running `vllm serve` lists its models at once."""
STARTUP_POLL_S = 2.0
"""How often the start asks the servers that did not answer yet, while `rollout.vllm.startup_wait_s` lasts."""


def check_reachable(urls: tuple[str, ...], timeout: float = PROBE_TIMEOUT, wait_s: float = 0.0) -> None:
    """Refuse, in one line naming the URL, a server that does not answer `GET /v1/models` within `wait_s`
    seconds (0: at once): asked before the model loads, so a server that is down or a mistyped URL ends the
    run in seconds, while servers started beside the trainer may take `wait_s` to load their model. What
    the server serves is checked once the model is loaded (`treetrain.rollout.engines.server_checks`)."""
    silent = {url.rstrip("/"): "" for url in urls}
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        for base in list(silent):
            try:
                call_server(base, "/v1/models", None, timeout)
                del silent[base]
            except EngineError as exc:
                silent[base] = str(exc).removeprefix(f"vllm-server {base}/v1/models: ")
        left = deadline - time.monotonic()
        if not silent:
            return
        if left <= 0:
            base, why = next(iter(silent.items()))
            waited = f" after waiting {wait_s:g} s (rollout.vllm.startup_wait_s)" if wait_s else ""
            raise EngineError(
                f"rollout.vllm.urls: no vllm serve answers at {base}{waited} (GET /v1/models: {why}); start the "
                "server first or correct the URL"
            ) from None
        if not waiting:
            log.warning(
                "waiting up to %g s for %d of %d servers to answer GET /v1/models (rollout.vllm.startup_wait_s): "
                "%s", wait_s, len(silent), len(urls), ", ".join(silent),
            )  # fmt: skip
            waiting = True
        time.sleep(min(STARTUP_POLL_S, left))
