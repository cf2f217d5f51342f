"""What a `vllm serve` process must be before treetrain samples from it, read from the server itself.

A server started with other flags than the run needs samples something else than the trainer scores, and
nothing in its answers says so: a bfloat16 server beside a float32 trainer gives a logprob gap of 1e-3
on average, raw logprobs are not the distribution a token was drawn from at a temperature other than 1,
and a server without prefix caching re-encodes every tree's shared context. So before the first rollout
the engine reads each server's configuration (`GET /v1/models`, and `GET /server_info`, which
`VLLM_SERVER_DEV_MODE=1` provides, as it does the reload call) and refuses a mismatch in one line that
names the flag to change. After every weight reload, a probe scores a fixed prompt on the server and
compares it with the trainer's own logprobs (`trainer_probe`, `served_prompt_logprobs`): that catches weights that did not arrive (a
server reading another copy of the run directory) and a server serving another model.

Example:
    >>> served = ServedConfig(model="m", root="/ckpt", max_model_len=1024, dtype="bfloat16",
    ...     prefix_caching=True, logprobs_mode="processed_logprobs", chunked_prefill=False,
    ...     max_num_batched_tokens=8192, max_num_seqs=128, device="cpu")
    >>> print(mismatch(served, Expected(path="/ckpt", dtype="float32", max_model_len=1024)))
    it serves bfloat16 weights and the trainer runs float32: start it with --dtype float32
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetrain.rollout.engines.generation import EngineError
from treetrain.rollout.engines.server_calls import ServerHTTPError, call_server, short

LOGPROBS_MODE = "processed_logprobs"
"""The sampled distribution after temperature and top-p, as the other engines record it."""
DEV_MODE = "start the server with VLLM_SERVER_DEV_MODE=1, which treetrain needs to read its settings and reload weights"
PROBE_LENGTH = 32
"""Tokens of the probe prompt scored after every reload."""
PROBE_TOLERANCE = {"float32": 1e-3}
"""Largest |server - trainer| prompt logprob on the probe, by dtype: in float32 it measured 7e-6 on the
demo model, and 2.9 after one AdamW step at lr 1e-3 that the server did not receive. At half precision
rounding alone moves a logprob by up to about 0.1 (0.085 between a bfloat16 server and a float32
trainer), so there the probe only catches weights that did not arrive at all."""
HALF_PRECISION_TOLERANCE = 0.25
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
"""The config fields that say whether a served checkpoint is this run's model at all."""


@dataclass(frozen=True)
class Expected:
    """What the run needs from every server: its model, the trainer's dtype, and its longest context."""

    path: str
    """The run's `model.path`, resolved (named in messages only: the probe checks the model itself)."""
    dtype: str
    """`model.dtype`: the server must compute in it too."""
    max_model_len: int
    """The longest context a rollout sends (the episode budget)."""
    shape: tuple[tuple[str, int], ...] = ()
    """The trainer's `SHAPE_FIELDS`, compared with the served checkpoint's `config.json` when the server
    names it by an absolute path this machine can read."""

    @staticmethod
    def shape_of(config: Any) -> tuple[tuple[str, int], ...]:
        """`SHAPE_FIELDS` of a transformers config (its text config for a multimodal model)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return tuple((f, int(v)) for f in SHAPE_FIELDS if isinstance(v := getattr(text, f, None), int))


@dataclass(frozen=True)
class ServedConfig:
    """A server's settings, as `/v1/models` and `/server_info?config_format=json` report them."""

    model: str
    """The served model's name, which every request names."""
    root: str
    """Where the server loaded it from (its `--model`)."""
    max_model_len: int
    dtype: str
    """`float32`, `bfloat16`, ... (torch's name without `torch.`)."""
    prefix_caching: bool
    logprobs_mode: str
    chunked_prefill: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    device: str
    weight_transfer: str = ""
    """The backend of its `--weight-transfer-config` ("" without one)."""


def served_config(models: Any, info: Any) -> ServedConfig:
    """Parse the two answers; a `KeyError`, `TypeError` or `ValueError` when one is outside vLLM's protocol."""
    card = models["data"][0]
    config = info["vllm_config"]
    model, cache, scheduler = config["model_config"], config["cache_config"], config["scheduler_config"]
    device = config.get("device_config", {}).get("device", "")
    transfer = config.get("weight_transfer_config") or {}
    return ServedConfig(
        model=str(card["id"]), root=str(card.get("root") or card["id"]),
        max_model_len=int(card.get("max_model_len") or model["max_model_len"]),
        dtype=str(model["dtype"]).removeprefix("torch."), prefix_caching=bool(cache["enable_prefix_caching"]),
        logprobs_mode=str(model["logprobs_mode"]), chunked_prefill=bool(scheduler["enable_chunked_prefill"]),
        max_num_batched_tokens=int(scheduler["max_num_batched_tokens"]),
        max_num_seqs=int(scheduler["max_num_seqs"]), device=str(device),
        weight_transfer=str(transfer.get("backend", "")) if isinstance(transfer, dict) else "",
    )  # fmt: skip


def check_server(url: str, expected: Expected, timeout: float, transfer: str | None = None) -> ServedConfig:
    """What `url` serves (`/v1/models`, `/server_info`), refused in one `EngineError` line when it cannot
    sample for the run, or cannot take weights over `transfer` (a `--weight-transfer-config` backend)."""
    models = call_server(url, "/v1/models", None, timeout)
    try:
        info = call_server(url, "/server_info?config_format=json", None, timeout)
    except ServerHTTPError as exc:
        if exc.code != 404:
            raise
        raise EngineError(f"vllm-server {url}/server_info: not found: {DEV_MODE}") from None
    try:
        served = served_config(models, info)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"vllm-server {url}: /v1/models or /server_info answered outside vLLM's protocol ({short(exc)})"
        ) from None
    problem = mismatch(served, expected)
    if problem is None and transfer is not None and served.weight_transfer != transfer:
        problem = (
            f"rollout.vllm.weight_sync=gloo streams weights into it, and it was started "
            f"{'without --weight-transfer-config' if not served.weight_transfer else 'with the weight transfer backend ' + repr(served.weight_transfer)}: "
            f'start it with --weight-transfer-config \'{{"backend": "{transfer}"}}\' (treetrain installed beside '
            "vLLM), or set rollout.vllm.weight_sync=files"
        )
    if problem is not None:
        raise EngineError(f"vllm-server {url} (serving {served.root}): {problem}")
    return served


def check_held(url: str, label: str, when: str, timeout: float) -> None:
    """Server `url` still holds weight version `label` (`GET /weight_info`); otherwise one `EngineError` line
    saying what it holds instead (a `ServerLostError` when it does not answer)."""
    answer = call_server(url, "/weight_info", None, timeout)
    found = answer.get("weight_version") if isinstance(answer, dict) else None
    if not isinstance(found, str):
        raise EngineError(f"vllm-server {url}/weight_info: no weight_version in {short(answer)}")
    if found != label:
        raise EngineError(
            f"vllm-server {url}: its weights are no longer this run's ({when} its weight version is "
            f"{found!r}, expected {label!r}): it was restarted or reloaded by someone else; "
            "continue with --resume, which reloads it"
        )


def model_mismatch(root: str, expected: Expected) -> str | None:
    """Why the checkpoint at `root` is not the run's model, when `root` is an absolute path to a readable
    checkpoint here (the shared filesystem the weights go through); None otherwise."""
    path = Path(root) / "config.json"
    try:
        if not Path(root).is_absolute() or not path.is_file() or path.stat().st_size > 2**20:
            return None
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    for field, ours in expected.shape:
        theirs = text.get(field) if isinstance(text, dict) else None
        if isinstance(theirs, int) and theirs != ours:
            return (
                f"it serves another model than this run's ({field} {theirs}, the trainer's {ours}): start it with "
                f"--model pointing at this run's checkpoint ({expected.path})"
            )
    return None


def mismatch(served: ServedConfig, expected: Expected) -> str | None:
    """Why this server cannot sample for the run, naming the flag to change; None when it can."""
    wrong_model = model_mismatch(served.root, expected)
    if wrong_model is not None:
        return wrong_model
    if served.max_model_len < expected.max_model_len:
        return (
            f"it serves contexts of at most {served.max_model_len} tokens and this run's episodes take up to "
            f"{expected.max_model_len}: start it with --max-model-len {expected.max_model_len} (or lower "
            "rollout.episode.max_episode_tokens)"
        )
    if served.dtype != expected.dtype:
        return (
            f"it serves {served.dtype} weights and the trainer runs {expected.dtype}: start it with "
            f"--dtype {expected.dtype}"
        )
    if served.logprobs_mode != LOGPROBS_MODE:
        return (
            f"it returns {served.logprobs_mode}, not the logprobs of the distribution it sampled: start it "
            f"with --logprobs-mode {LOGPROBS_MODE}"
        )
    if not served.prefix_caching:
        return (
            "its prefix cache is off, so every branch would re-encode its whole context: start it with "
            "--enable-prefix-caching"
        )
    if (
        served.device == "cpu"
        and served.chunked_prefill
        and served.max_num_batched_tokens < (served.max_num_seqs * served.max_model_len)
    ):
        return (
            "on CPU, a prompt split over two steps crashes vLLM under per-request seeds ('CPU Generator does "
            "not use offset'): start it with --no-enable-chunked-prefill"
        )
    return None


def probe_tokens(vocab_size: int) -> list[int]:
    """A fixed prompt of token ids spread over the vocabulary (the same on every call).

    >>> probe_tokens(514)[:4]
    [3, 164, 325, 486]
    """
    return [(3 + 161 * i) % vocab_size for i in range(PROBE_LENGTH)]


def served_prompt_logprobs(answer: Any, tokens: list[int]) -> list[float]:
    """The logprob of each prompt token after the first, from a completions answer with `prompt_logprobs=0`."""
    entries = answer["choices"][0]["prompt_logprobs"]
    if not isinstance(entries, list) or len(entries) != len(tokens):
        raise ValueError(
            f"prompt_logprobs holds {len(entries) if isinstance(entries, list) else '?'} entries"
        )
    return [float(entries[i][str(t)]["logprob"]) for i, t in enumerate(tokens) if i > 0]


def trainer_probe(model: Any) -> tuple[list[int], list[float]]:
    """The probe prompt for `model`'s vocabulary and the trainer's logprob of each of its tokens after the
    first (a DeepSpeed engine is unwrapped; the model is in eval mode during a rollout)."""
    import torch

    from treetrain.rollout.engines.weight_buckets import full_shape

    module = getattr(model, "module", model) if type(model).__name__ == "DeepSpeedEngine" else model
    embeddings = module.get_input_embeddings()
    rows = full_shape(embeddings.weight)  # ZeRO-3 holds a partition
    tokens = probe_tokens(int(rows[0]))
    device = embeddings.weight.device
    with torch.no_grad():
        logits = module(input_ids=torch.tensor([tokens], device=device)).logits[0].float()
    own = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(tokens[1:], device=device)[:, None])[:, 0]
    return tokens, [float(x) for x in own.cpu()]


def probe_tolerance(dtype: str) -> float:
    """Largest probe gap accepted at `dtype`.

    >>> probe_tolerance("float32"), probe_tolerance("bfloat16")
    (0.001, 0.25)
    """
    return PROBE_TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)
