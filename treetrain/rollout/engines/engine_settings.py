"""Which inference engine samples the rollouts, and how vLLM is started or reached (`rollout.vllm`).

Kept apart from the engines so that reading a config imports neither torch nor vLLM: a bad URL is refused
before anything loads.

Example:
    >>> VLLMSettings(urls=("http://127.0.0.1:8000",)).urls
    ('http://127.0.0.1:8000',)
    >>> VLLMSettings(urls=("localhost:8000",))
    Traceback (most recent call last):
    ...
    treetrain.errors.ConfigError: urls: 'localhost:8000' is not an http(s) URL with a host (e.g. http://127.0.0.1:8000)
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from treetrain.errors import ConfigError

ENGINES: tuple[str, ...] = ("hf", "vllm", "vllm-server")
"""`rollout.engine`: the trainer's own model, vLLM in this process, or `vllm serve` processes."""
WEIGHT_SYNCS: tuple[str, ...] = ("files", "gloo")
"""`rollout.vllm.weight_sync`: how `vllm serve` processes take new weights."""


def url_problem(url: object) -> str | None:
    """Why `url` is not a server base URL, or None."""
    if not isinstance(url, str) or len(url) > 2048:
        return f"{url!r:.80} is not a URL"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"{url!r:.80} is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r:.80} is not an http(s) URL with a host (e.g. http://127.0.0.1:8000)"
    if parts.query or parts.fragment or port == 0:
        return f"{url!r:.80} has a query, a fragment or port 0; give the server's base URL"
    return None


@dataclass(frozen=True)
class VLLMSettings:
    """How the `vllm` engine starts and the `vllm-server` engine connects; the trainer's `rollout.vllm`."""

    urls: tuple[str, ...] = ()
    """Base URLs of running `vllm serve` processes (rollout.engine=vllm-server), e.g.
    `http://127.0.0.1:8000`; a tree's requests stay on one server while it has room, so its prefix cache
    holds the tree, else go to the least loaded, and a server that stops answering is routed around
    (docs/rollout-engines.md). The servers must serve this run's model, started with `VLLM_SERVER_DEV_MODE=1` and the flags of
    docs/rollout-engines.md (`--dtype` the trainer's, processed logprobs, prefix caching), which are checked
    before the first rollout."""
    request_timeout_s: float = 600.0
    """Longest a server may stay silent on a request (for a streamed answer: between two events) before it
    is counted lost and its samples go on at the other servers; with none left the rollout stops, naming
    the URLs."""
    startup_wait_s: float = 0.0
    """How long a run's start (or resume) waits for every server to answer `GET /v1/models`, e.g. while the
    servers still load the model after being started beside the trainer (0: a server that does not answer
    is refused at once, which also catches a mistyped URL in seconds)."""
    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory the in-process engine may take; the trainer needs the rest."""
    cpu_kv_cache_gib: float = 1.0
    """KV-cache size of the in-process engine on a machine without a GPU, in GiB."""
    max_num_seqs: int = 256
    """Most sequences the in-process engine decodes at once."""
    weight_sync: str = "files"
    """How the servers take each version (docs/rollout-engines.md): `files`, safetensors under the run
    directory that each server reads (a filesystem the servers share, at the same path); or `gloo`, streamed
    by rank 0 into each server through vLLM's weight-transfer API (`/update_weights`) over a gloo group, no
    disk, for servers started with `--weight-transfer-config '{"backend": "treetrain_gloo"}'` and treetrain
    installed beside vLLM. `gloo` sends the full weights (LoRA merged) and is for synchronous runs
    (`rollout.max_staleness: 0`)."""
    transfer_host: str = "127.0.0.1"
    """With `weight_sync: gloo`: the address of rank 0 that the servers' workers connect to, on a free port
    (torch's TCP store listens on every interface), e.g. the trainer machine's address on the network the
    servers share with it."""

    def __post_init__(self) -> None:
        urls = self.urls
        if isinstance(urls, str) or not isinstance(urls, tuple | list):
            raise ConfigError(f"must be a list of URLs, got {urls!r:.80}", field="urls")
        for url in urls:
            problem = url_problem(url)
            if problem:
                raise ConfigError(problem, field="urls")
        if len(set(urls)) != len(urls):
            raise ConfigError("lists a URL twice", field="urls")
        object.__setattr__(self, "urls", tuple(urls))
        for name, low, high in (
            ("request_timeout_s", 0.0, 86400.0),
            ("gpu_memory_utilization", 0.0, 1.0),
            ("cpu_kv_cache_gib", 0.0, 1024.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high:
                raise ConfigError(f"must be a number in ({low:g}, {high:g}], got {value!r}", field=name)
        wait = self.startup_wait_s
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0.0 <= wait <= 86400.0:
            raise ConfigError(f"must be a number in [0, 86400], got {wait!r}", field="startup_wait_s")
        if (
            isinstance(self.max_num_seqs, bool)
            or not isinstance(self.max_num_seqs, int)
            or self.max_num_seqs < 1
        ):
            raise ConfigError(f"must be a positive integer, got {self.max_num_seqs!r}", field="max_num_seqs")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ConfigError(
                f"must be one of {WEIGHT_SYNCS}, got {self.weight_sync!r:.80}", field="weight_sync"
            )
        host = self.transfer_host
        if (
            not isinstance(host, str)
            or not 0 < len(host) <= 253
            or any(c.isspace() or c in "/:@?#[]" for c in host)
        ):
            raise ConfigError(f"must be a host name or IPv4 address, got {host!r:.80}", field="transfer_host")


def check_engine_choice(engine: object, settings: VLLMSettings) -> None:
    """Refuse, at config load, an engine name that is not one of `ENGINES`, or `vllm-server` without URLs.

    >>> check_engine_choice("vllm-server", VLLMSettings())
    Traceback (most recent call last):
    ...
    treetrain.errors.ConfigError: rollout.vllm.urls: rollout.engine=vllm-server needs the servers' base URLs
    """
    if engine not in ENGINES:
        raise ConfigError(f"rollout.engine: must be one of {ENGINES}, got {engine!r:.80}")
    if engine == "vllm-server" and not settings.urls:
        raise ConfigError("rollout.vllm.urls: rollout.engine=vllm-server needs the servers' base URLs")
