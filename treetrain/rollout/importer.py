"""Import externally sampled rollouts (chat-format JSONL with token ids) as trees that training consumes.

`import_jsonl(path, out_dir)` reads every line (schema in `treetrain.rollout.import_records`), assembles the
per-call records into `Trajectory`s, groups them, builds one `TrajectoryTree` per group and writes one
tree file per group into `out_dir`. Grouping is by the first call's prompt tokens (`GroupBy.PROMPT`, the
GRPO group of a prompt) or by the records' `group_id` (`GroupBy.GROUP_ID`).

All or nothing: every line is validated and every tree built and encoded before the first byte is
written. A problem raises `RecordError` with the line number and field, and `out_dir` is left untouched
(not even created). If writing fails part-way, `out_dir` is put back exactly as it was, files the import
overwrote included (`treetrain.io.write_files_all_or_nothing`).

Example:
    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rows = [{"trajectory_id": f"t{i}", "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5 + i],
    ...          "response_logprobs": [-0.5, -1.0], "reward": float(i)} for i in range(2)]
    >>> _ = (d / "in.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> result = import_jsonl(d / "in.jsonl", d / "trees")
    >>> from treetrain.tree.stats import tree_stats
    >>> len(result.trees), tree_stats(result.trees[0]).num_trajectories, len(result.paths)
    (1, 2, 1)
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
from array import array
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from treetrain.io import open_regular, path_problem, write_files_all_or_nothing
from treetrain.rollout.import_records import MAX_METADATA_ENTRIES, CallRecordIn, RecordError, parse_record
from treetrain.trajectory import Role, Trajectory, TrajectoryError, TrajectoryMeta
from treetrain.tree import TrajectoryTree
from treetrain.tree.build import build_tree
from treetrain.tree.format import file_bytes


class GroupBy(str, Enum):
    """How trajectories are grouped into trees."""

    PROMPT = "prompt"
    """Trajectories whose first call starts with the same prompt tokens (up to the first policy token)."""
    GROUP_ID = "group_id"
    """The records' `group_id` field (then required on every record)."""


@dataclass(frozen=True)
class ImportResult:
    """What an import produced: one tree per group, and the files written (same order)."""

    trees: tuple[TrajectoryTree, ...]
    groups: tuple[str, ...]
    paths: tuple[Path, ...]


MAX_LINE_BYTES = 1 << 27
"""Longest JSONL line read (128 MiB): one record is one call, and a longer line is refused before it is
held in memory whole."""


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (`json` would silently keep the last value)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_records(path: str | Path) -> Iterator[CallRecordIn]:
    """Validated records of a JSONL file, in order; blank lines are skipped."""
    source = str(path)
    with open_regular(path) as f:
        line_no = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            line_no += 1
            if len(raw) > MAX_LINE_BYTES:
                raise RecordError(
                    source, line_no, "<line>", f"longer than the limit of {MAX_LINE_BYTES} bytes"
                )
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecordError(source, line_no, "<encoding>", f"not UTF-8 (byte {exc.start})") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text, object_pairs_hook=_unique_keys)
            except _DuplicateKey as exc:
                raise RecordError(source, line_no, exc.key[:60], "duplicate key in one JSON object") from None
            except json.JSONDecodeError as exc:
                raise RecordError(
                    source, line_no, "<json>", f"invalid JSON: {exc.msg} at column {exc.colno}"
                ) from None
            except ValueError as exc:  # an integer of more digits than Python converts
                problem = str(exc).split(";")[0]
                raise RecordError(source, line_no, "<json>", f"invalid JSON: {problem}") from None
            except RecursionError:
                raise RecordError(source, line_no, "<json>", "nested too deeply") from None
            try:
                yield parse_record(obj, source, line_no)
            except RecursionError:
                raise RecordError(source, line_no, "<record>", "nested too deeply") from None


def _assemble(source: str, records: list[CallRecordIn]) -> Trajectory:
    """One trajectory from its records (any order); checks call indices, rewards and group ids agree."""
    seen: dict[int, int] = {}
    for rec in sorted(records, key=lambda r: r.line):
        if rec.call_index in seen:
            raise RecordError(
                source,
                rec.line,
                "call_index",
                f"duplicate call_index {rec.call_index} (also on line {seen[rec.call_index]})",
            )
        seen[rec.call_index] = rec.line
    records = sorted(records, key=lambda r: r.call_index)
    first = records[0]
    for want, rec in enumerate(records):
        if rec.call_index != want:
            raise RecordError(
                source,
                rec.line,
                "call_index",
                f"call_index {rec.call_index} of {rec.trajectory_id!r} but no call_index {want}",
            )
    given = sorted((r for r in records if r.reward is not None), key=lambda r: r.line)
    if not given:
        raise RecordError(
            source, records[-1].line, "reward", f"trajectory {first.trajectory_id!r} has no reward"
        )
    conflict = next((r for r in given if r.reward != given[0].reward), None)
    if conflict is not None:
        raise RecordError(
            source,
            conflict.line,
            "reward",
            f"{conflict.reward} conflicts with {given[0].reward} on line {given[0].line}",
        )
    for key in ("group_id", "env", "seed", "model_version"):
        values = {getattr(r, key) for r in records}
        if len(values) > 1:
            line = next(r.line for r in records if getattr(r, key) != getattr(first, key))
            raise RecordError(source, line, key, f"differs between calls of {first.trajectory_id!r}")
    with_steps = [r for r in records if r.step_rewards is not None]
    if with_steps and len(with_steps) != len(records):
        line = next(r.line for r in records if r.step_rewards is None)
        raise RecordError(
            source, line, "step_rewards", "given on some calls of the trajectory but not this one"
        )
    extra: dict[str, str] = {}
    for r in records:
        extra.update(r.metadata)
        if len(extra) > MAX_METADATA_ENTRIES:
            raise RecordError(
                source,
                r.line,
                "metadata",
                f"the trajectory's records hold over {MAX_METADATA_ENTRIES} entries",
            )
    last_messages = [r.messages for r in records if r.messages is not None]
    if last_messages:
        extra["messages"] = last_messages[-1]
    if first.group_id is not None:
        extra["group_id"] = first.group_id
    meta = TrajectoryMeta(
        env=first.env or "", seed=first.seed, model_version=first.model_version, extra=extra
    )
    steps = tuple(x for r in with_steps for x in (r.step_rewards or ()))
    reward = given[0].reward
    assert reward is not None
    try:
        return Trajectory(first.trajectory_id, tuple(r.call for r in records), reward, steps, meta)
    except TrajectoryError as exc:
        raise RecordError(source, first.line, "trajectory_id", str(exc)) from None


def _prompt_key(traj: Trajectory) -> str:
    call = traj.calls[0]
    toks = call.tokens[: next((i for i, r in enumerate(call.roles) if r is Role.POLICY), len(call.roles))]
    return "prompt-" + hashlib.sha256(array("Q", toks).tobytes()).hexdigest()[:16]


def group_trajectories(
    source: str | Path, records: list[CallRecordIn], group_by: GroupBy = GroupBy.PROMPT
) -> dict[str, list[Trajectory]]:
    """Trajectories keyed by group, groups and members in first-appearance order."""
    src = str(source)
    by_traj: dict[str, list[CallRecordIn]] = defaultdict(list)
    for rec in records:
        if group_by is GroupBy.GROUP_ID and rec.group_id is None:
            raise RecordError(src, rec.line, "group_id", "missing (required with --group-by group_id)")
        by_traj[rec.trajectory_id].append(rec)
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for recs in by_traj.values():
        traj = _assemble(src, recs)
        key = recs[0].group_id if group_by is GroupBy.GROUP_ID else _prompt_key(traj)
        assert key is not None
        groups[key].append(traj)
    return dict(groups)


def _file_name(group: str, tree: TrajectoryTree) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", group).strip("._")[:64] or "group"
    return f"{safe}-{tree.id[:12]}.msgpack"


def import_jsonl(path: str | Path, out_dir: str | Path, group_by: GroupBy = GroupBy.PROMPT) -> ImportResult:
    """Validate `path`, build one tree per group and write them to `out_dir` (all or nothing)."""
    if not str(out_dir):  # Path("") is the working directory: an unset shell variable, not a choice
        raise FileNotFoundError(errno.ENOENT, "an empty path is not an output directory", "")
    if (problem := path_problem(path, "file")) is not None:
        raise FileNotFoundError(problem)
    if Path(out_dir).exists() and (problem := path_problem(out_dir, "directory")) is not None:
        raise FileExistsError(f"output directory: {problem}")
    records = list(read_records(path))
    if not records:
        raise RecordError(str(path), 0, "<file>", "no records")
    groups = group_trajectories(path, records, group_by)
    trees = {g: build_tree(ts) for g, ts in groups.items()}
    names = [(Path(out_dir) / _file_name(g, t), t) for g, t in trees.items()]
    payloads = [
        (path, file_bytes([t], str(path))) for path, t in names
    ]  # every file checked before any is written
    write_files_all_or_nothing(payloads)
    return ImportResult(tuple(trees.values()), tuple(trees), tuple(p for p, _ in payloads))
