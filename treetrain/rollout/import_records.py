"""The JSONL import schema: one externally sampled trajectory (or one call of it) per line.

This is what vLLM/SGLang-style pipelines write. Each line is a JSON object with these fields:

| field | type | |
|---|---|---|
| `trajectory_id` | string | required; records of one multi-call trajectory share it |
| `call_index` | int >= 0 | optional, default 0; one record per call, indices 0..n-1 |
| `group_id` | string | optional; trajectories normalized together (`--group-by group_id`) |
| `segments` | list of `{role, token_ids, logprobs?}` | role is prompt / policy / observation |
| `prompt_token_ids`, `response_token_ids`, `response_logprobs?` | int lists, float list | instead of `segments`: one prompt and one policy segment |
| `reward` | number | required on at least one record of a trajectory; every given value must agree |
| `step_rewards` | list of numbers | optional; one per policy segment of this record |
| `env`, `seed`, `model_version` | string, int, int | optional provenance |
| `metadata` | object | optional; values kept as strings (non-strings as JSON) |
| `messages` | list of `{role, content, ...}` | optional; the chat for display, kept as JSON in metadata |

Token ids are the sampler's ids: nothing is re-tokenized. `logprobs` (only on policy segments) are the
sampler's per-token logprobs. Unknown fields are rejected, so a typo never silently drops data; put
free-form data under `metadata`.

Every problem raises `RecordError` with the line number and the field, e.g.
`rollouts.jsonl:12: field 'segments[1].logprobs': 3 logprobs for 4 token_ids`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from treetrain.errors import TreetrainError
from treetrain.trajectory import Call, Role, Segment, TrajectoryError
from treetrain.tree.schema import DEFAULT_LIMITS

MAX_STR_BYTES = DEFAULT_LIMITS.max_str_bytes
"""Longest string field (ids, env, each metadata key and value, the messages JSON), in UTF-8 bytes: what
the tree format stores (`Limits.max_str_bytes`), so an imported file always loads again."""
MAX_METADATA_ENTRIES = DEFAULT_LIMITS.max_map_len - 2
"""Most metadata entries of a trajectory (over all its records), leaving room for `messages` and
`group_id`: the tree format's `Limits.max_map_len`."""

FIELDS = frozenset(
    {
        "trajectory_id",
        "call_index",
        "group_id",
        "segments",
        "prompt_token_ids",
        "response_token_ids",
        "response_logprobs",
        "reward",
        "step_rewards",
        "env",
        "seed",
        "model_version",
        "metadata",
        "messages",
    }
)
SEGMENT_FIELDS = frozenset({"role", "token_ids", "logprobs"})


class RecordError(TreetrainError, ValueError):
    """An invalid import record: `source`, 1-based `line` and `field` say where."""

    def __init__(self, source: str, line: int, field: str, problem: str) -> None:
        super().__init__(f"{source}:{line}: field {field!r}: {problem}")
        self.source, self.line, self.field, self.problem = source, line, field, problem


@dataclass(frozen=True)
class CallRecordIn:
    """One validated line: a single call of a trajectory plus the trajectory-level fields it carries."""

    line: int
    trajectory_id: str
    call_index: int
    group_id: str | None
    call: Call
    reward: float | None
    step_rewards: tuple[float, ...] | None
    env: str | None
    seed: int | None
    model_version: int | None
    metadata: Mapping[str, str]
    messages: str | None
    """The `messages` field re-encoded as compact JSON, or None."""


class _Line:
    """Field accessors that raise `RecordError` naming the line and field."""

    def __init__(self, source: str, line: int, obj: Mapping[str, Any]) -> None:
        self.source, self.line, self.obj = source, line, obj

    def fail(self, field: str, problem: str) -> RecordError:
        return RecordError(self.source, self.line, field, problem)

    def int_(self, value: Any, field: str, minimum: int = -(2**63), limit: int = 2**63) -> int:
        """An integer in [minimum, limit): the tree format stores int64 metadata and uint32 token ids."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"expected an integer, got {_show(value)}")
        if not minimum <= value < limit:
            raise self.fail(field, f"must be in [{minimum}, {limit}), got {_show(value)}")
        return value

    def number(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f"expected a finite number, got {_show(value)}")
        try:
            out = float(value)
        except OverflowError:
            out = math.inf
        if not math.isfinite(out):
            raise self.fail(field, f"expected a finite number, got {_show(value)}")
        return out

    def string(self, value: Any, field: str, *, empty: bool = False) -> str:
        if not isinstance(value, str) or not (value or empty):
            raise self.fail(field, f"expected a non-empty string, got {_show(value)}")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise self.fail(
                field, f"not valid Unicode (a lone surrogate {value[exc.start]!r} at character {exc.start})"
            ) from None
        if size > MAX_STR_BYTES:
            raise self.fail(field, f"{size} bytes of UTF-8, over the limit of {MAX_STR_BYTES}")
        return value

    def tokens(self, value: Any, field: str) -> tuple[int, ...]:
        if not isinstance(value, list) or not value:
            raise self.fail(field, "expected a non-empty list of token ids")
        return tuple(self.int_(t, f"{field}[{i}]", minimum=0, limit=2**32) for i, t in enumerate(value))

    def logprobs(self, value: Any, field: str, n: int) -> tuple[float, ...]:
        if not isinstance(value, list):
            raise self.fail(field, "expected a list of numbers")
        out = tuple(self.number(x, f"{field}[{i}]") for i, x in enumerate(value))
        if any(x > 0 for x in out):
            raise self.fail(field, "logprobs must be <= 0")
        if len(out) != n:
            raise self.fail(field, f"{len(out)} logprobs for {n} token_ids")
        return out


def _segments(rec: _Line) -> tuple[Segment, ...]:
    obj = rec.obj
    has_segments = "segments" in obj
    has_flat = "prompt_token_ids" in obj or "response_token_ids" in obj
    if has_segments == has_flat:
        raise rec.fail("segments", "give either 'segments' or 'prompt_token_ids' + 'response_token_ids'")
    if has_flat:
        for key in ("prompt_token_ids", "response_token_ids"):
            if key not in obj:
                raise rec.fail(key, "missing (needed with the vLLM-style fields)")
        prompt = rec.tokens(obj["prompt_token_ids"], "prompt_token_ids")
        response = rec.tokens(obj["response_token_ids"], "response_token_ids")
        lps = obj.get("response_logprobs")
        logprobs = None if lps is None else rec.logprobs(lps, "response_logprobs", len(response))
        return (Segment(Role.PROMPT, prompt), Segment(Role.POLICY, response, logprobs))
    if "response_logprobs" in obj:
        raise rec.fail("response_logprobs", "only valid with 'response_token_ids'; put logprobs in segments")
    raw = obj["segments"]
    if not isinstance(raw, list) or not raw:
        raise rec.fail("segments", "expected a non-empty list")
    out: list[Segment] = []
    for i, seg in enumerate(raw):
        where = f"segments[{i}]"
        if not isinstance(seg, dict):
            raise rec.fail(where, "expected an object with role and token_ids")
        unknown = sorted(set(seg) - SEGMENT_FIELDS)
        if unknown:
            raise rec.fail(f"{where}.{unknown[0]}", f"unknown field; a segment has {sorted(SEGMENT_FIELDS)}")
        roles = [r.value for r in Role]
        if seg.get("role") not in roles:
            raise rec.fail(f"{where}.role", f"expected one of {roles}, got {_show(seg.get('role'))}")
        role = Role(seg["role"])
        if "token_ids" not in seg:
            raise rec.fail(f"{where}.token_ids", "missing")
        toks = rec.tokens(seg["token_ids"], f"{where}.token_ids")
        lps = seg.get("logprobs")
        if lps is not None and role is not Role.POLICY:
            raise rec.fail(f"{where}.logprobs", f"only policy segments carry logprobs, this is {role.value}")
        logprobs = None if lps is None else rec.logprobs(lps, f"{where}.logprobs", len(toks))
        out.append(Segment(role, toks, logprobs))
    return tuple(out)


def parse_record(obj: Any, source: str, line: int) -> CallRecordIn:
    """Validate one decoded JSON line."""
    if not isinstance(obj, dict):
        raise RecordError(source, line, "<record>", f"expected a JSON object, got {type(obj).__name__}")
    rec = _Line(source, line, obj)
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise rec.fail(unknown[0], "unknown field; put free-form data under 'metadata'")
    if "trajectory_id" not in obj:
        raise rec.fail("trajectory_id", "missing")
    tid = rec.string(obj["trajectory_id"], "trajectory_id")
    call_index = 0 if obj.get("call_index") is None else rec.int_(obj["call_index"], "call_index", minimum=0)
    group = None if obj.get("group_id") is None else rec.string(obj["group_id"], "group_id")
    try:
        call = Call(_segments(rec))
    except TrajectoryError as exc:
        raise rec.fail("segments", str(exc)) from None
    reward = None if obj.get("reward") is None else rec.number(obj["reward"], "reward")
    step_rewards = None
    if obj.get("step_rewards") is not None:
        if not isinstance(obj["step_rewards"], list):
            raise rec.fail("step_rewards", "expected a list of numbers")
        step_rewards = tuple(rec.number(x, f"step_rewards[{i}]") for i, x in enumerate(obj["step_rewards"]))
        n_policy = sum(1 for s in call.segments if s.role is Role.POLICY)
        if len(step_rewards) != n_policy:
            raise rec.fail("step_rewards", f"{len(step_rewards)} values for {n_policy} policy segments")
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise rec.fail("metadata", "expected an object")
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise rec.fail("metadata", f"{len(metadata)} entries, over the limit of {MAX_METADATA_ENTRIES}")
    messages = obj.get("messages")
    well_formed = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    )
    if messages is not None and not well_formed:
        raise rec.fail("messages", "expected a list of objects with a string 'role'")
    return CallRecordIn(
        line=line,
        trajectory_id=tid,
        call_index=call_index,
        group_id=group,
        call=call,
        reward=reward,
        step_rewards=step_rewards,
        env=None if obj.get("env") is None else rec.string(obj["env"], "env"),
        seed=None if obj.get("seed") is None else rec.int_(obj["seed"], "seed"),
        model_version=None
        if obj.get("model_version") is None
        else rec.int_(obj["model_version"], "model_version"),
        metadata={
            rec.string(k, f"metadata key {_show(k)}", empty=True): rec.string(
                v if isinstance(v, str) else json.dumps(v), f"metadata[{_show(k)}]", empty=True
            )
            for k, v in metadata.items()
        },
        messages=None
        if messages is None
        else rec.string(json.dumps(messages, separators=(",", ":")), "messages", empty=True),
    )


def _show(value: Any, limit: int = 60) -> str:
    """A value as JSON for a message, cut so that a hostile value cannot flood it."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
