"""The validating reader of tree files: untrusted bytes in, `TrajectoryTree`s or a `TreeFormatError` out.

Nothing is trusted. msgpack runs with size limits (a declared length can never exceed the limit or the
bytes present), ext types and duplicate map keys are refused, and every field is checked for type,
length and range before it is used. The node list must be exactly what `build_tree` produces
from the stored trajectories: one empty root at index 0, parents before children, depth-first pre-order
with siblings sorted by their first (token, role), and every node a maximal run. So a file that loads
always equals the tree rebuilt from its own trajectories, and node ids and the tree id are recomputed,
never taken on trust; stored ids must match.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treetrain.trajectory import REWARD_LIMIT, VERSION_LIMIT, TrajectoryError, TrajectoryMeta
from treetrain.tree.node_table import POLICY, ROLES, Budget, NodeTable
from treetrain.tree.schema import FORMAT_NAME, SAMPLING_VERSION, SUPPORTED_VERSIONS, Limits, TreeFormatError
from treetrain.tree.trajectory_tree import CallRecord, SamplingRecord, TrajectoryRecord, TrajectoryTree
from treetrain.tree.unpack import (
    MAP_HEADERS,
    expect_array,
    expect_bin,
    expect_fields,
    expect_finite,
    expect_int,
    expect_optional_int,
    expect_str,
    kind,
    short_repr,
    unpack_limited,
)


# ----- document ---------------------------------------------------------------------------------------
def decode_trees(data: bytes, limits: Limits) -> tuple[TrajectoryTree, ...]:
    """Parse and validate a whole file; the trees of its group, in file order."""
    if data and data[0] not in MAP_HEADERS:
        raise TreeFormatError(
            f"file: not a treetrain tree file ({_looks_like(data)}; tree files are msgpack maps)"
        )
    top = unpack_limited(data, limits, check_top=_check_top)
    assert isinstance(top, dict)  # _check_top refused anything else
    if "version" not in top:
        raise TreeFormatError("file: missing field 'version'")
    version = expect_int(top["version"], "file.version")
    if version not in SUPPORTED_VERSIONS:
        newest = max(SUPPORTED_VERSIONS)
        hint = "; written by a newer treetrain? upgrade" if version > newest else ""
        known = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
        raise TreeFormatError(f"file.version: {version} is not supported (this reader knows {known}){hint}")
    fields = expect_fields(top, "file", ("format", "version", "trees"))
    raw_trees = expect_array(fields["trees"], "trees", min_len=1)
    budget = Budget(limits.max_total_tokens, _TOKENS)
    visits = Budget(max(limits.min_node_visits, limits.node_visits_per_byte * len(data)), _VISITS)
    trees = tuple(_decode_tree(t, f"trees[{k}]", budget, visits, version) for k, t in enumerate(raw_trees))
    _check_distinct(trees)
    return trees


def _check_top(top: object) -> None:
    if not isinstance(top, dict):
        raise TreeFormatError(f"file: expected a map at the top level, got {kind(top)}; not a tree file")
    if top.get("format") != FORMAT_NAME:
        raise TreeFormatError(
            f"file.format: {short_repr(top.get('format'))} is not {FORMAT_NAME!r}; not a treetrain tree file"
        )


def _looks_like(data: bytes) -> str:
    """What a file that is not a tree file seems to be, from its first bytes, for the message."""
    head = data[:4096]
    if head[8:9] == b"{":  # an 8-byte little-endian header length, then the JSON header
        return "it looks like a safetensors file"
    if head.lstrip()[:1] in (b"{", b"["):
        return "it looks like JSON or JSONL; `treetrain import` turns rollout JSONL into trees"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # a multi-byte character cut at the end of `head` is still text
            return f"it starts with byte 0x{data[0]:02x}"
    return "it looks like text"


def _check_distinct(trees: Sequence[TrajectoryTree]) -> None:
    """A group holding one tree twice would train its trajectories twice, and two trees sharing a trajectory
    id would make one id name two trajectories of the group; refuse both, naming the ids."""
    first: dict[str, int] = {}
    owner: dict[str, int] = {}
    for k, tree in enumerate(trees):
        if tree.id in first:
            ids = ", ".join(short_repr(r.id, 24) for r in tree.records[:3])
            more = f" and {len(tree.records) - 3} more" if len(tree.records) > 3 else ""
            raise TreeFormatError(
                f"trees[{k}]: the same tree as trees[{first[tree.id]}] (id {tree.id}), so its trajectories "
                f"{ids}{more} would appear twice in the group"
            )
        first[tree.id] = k
        for ti, rec in enumerate(tree.records):
            if rec.id in owner:
                raise TreeFormatError(
                    f"trees[{k}].trajectories[{ti}].id: {short_repr(rec.id, 24)} is also the id of a trajectory "
                    f"in trees[{owner[rec.id]}]; trajectory ids must be unique within a group"
                )
            owner[rec.id] = k


_TOKENS = "{where}: the calls so far hold {used} tokens in total, over the limit of {limit}"
_VISITS = (
    "{where}: the trajectories pass through more than {limit} nodes in total (each node counted once per "
    "trajectory), over the limit (Limits.node_visits_per_byte x the file size)"
)


def _decode_tree(obj: object, where: str, budget: Budget, visits: Budget, version: int) -> TrajectoryTree:
    if version < SAMPLING_VERSION and isinstance(obj, dict) and "sampling" in obj:
        raise TreeFormatError(
            f"{where}.sampling: a version {version} file has no such field (version {SAMPLING_VERSION} added it)"
        )
    fields = expect_fields(obj, where, ("nodes", "trajectories"), ("id", "sampling"))
    nodes = NodeTable(expect_array(fields["nodes"], f"{where}.nodes", min_len=1), f"{where}.nodes")
    raw_trajs = expect_array(fields["trajectories"], f"{where}.trajectories", min_len=1)
    records: list[TrajectoryRecord] = []
    first_with_id: dict[str, int] = {}
    for ti, raw in enumerate(raw_trajs):
        rec = _decode_trajectory(raw, f"{where}.trajectories[{ti}]", nodes, budget, version)
        if rec.id in first_with_id:
            raise TreeFormatError(
                f"{where}.trajectories[{ti}].id: {short_repr(rec.id)} duplicates trajectories[{first_with_id[rec.id]}].id"
            )
        first_with_id[rec.id] = ti
        records.append(rec)
    sampling = _decode_sampling(fields["sampling"], f"{where}.sampling") if "sampling" in fields else None
    tree = TrajectoryTree(nodes.freeze(records, visits, where), records, sampling)
    if "id" in fields and expect_str(fields["id"], f"{where}.id") != tree.id:
        raise TreeFormatError(
            f"{where}.id: stored {short_repr(fields['id'])} but the content hash is {tree.id!r}"
        )
    return tree


def _decode_sampling(obj: object, where: str) -> SamplingRecord:
    fields = expect_fields(obj, where, ("temperature", "top_p"))
    temperature = expect_finite(fields["temperature"], f"{where}.temperature")
    top_p = expect_finite(fields["top_p"], f"{where}.top_p")
    try:
        return SamplingRecord(temperature, top_p)
    except TrajectoryError as e:  # its message starts with the field's name
        raise TreeFormatError(f"{where}.{e}") from None


# ----- trajectories -----------------------------------------------------------------------------------


def _decode_trajectory(
    obj: object, where: str, nodes: NodeTable, budget: Budget, version: int
) -> TrajectoryRecord:
    fields = expect_fields(obj, where, ("id", "reward", "step_rewards", "meta", "calls"))
    tid = expect_str(fields["id"], f"{where}.id")
    if not tid:
        raise TreeFormatError(f"{where}.id: empty; trajectory ids must be non-empty")
    reward = _reward(fields["reward"], f"{where}.reward")
    raw_steps = expect_array(fields["step_rewards"], f"{where}.step_rewards")
    steps = tuple(_reward(x, f"{where}.step_rewards[{j}]") for j, x in enumerate(raw_steps))
    meta = _decode_meta(fields["meta"], f"{where}.meta")
    raw_calls = expect_array(fields["calls"], f"{where}.calls", min_len=1)
    calls = tuple(
        _decode_call(c, f"{where}.calls[{ci}]", nodes, budget, version) for ci, c in enumerate(raw_calls)
    )
    n_policy = sum(len(c.logprobs) for c in calls)
    if steps and len(steps) != n_policy:
        raise TreeFormatError(
            f"{where}.step_rewards: {len(steps)} entries but the trajectory has {n_policy} policy segments "
            "(give one per policy segment, or none)"
        )
    if not any(nodes.has_policy[c.end] for c in calls):
        raise TreeFormatError(f"{where}: trajectory {tid!r} has no policy tokens, so nothing to train on")
    return TrajectoryRecord(tid, reward, steps, meta, calls)


def _decode_meta(obj: object, where: str) -> TrajectoryMeta:
    fields = expect_fields(obj, where, ("env", "seed", "model_version", "extra"))
    raw_extra = fields["extra"]
    if not isinstance(raw_extra, dict):
        raise TreeFormatError(f"{where}.extra: expected a map, got {kind(raw_extra)}")
    extra: dict[str, str] = {}
    for k, v in raw_extra.items():
        key = expect_str(k, f"{where}.extra key")
        extra[key] = expect_str(v, f"{where}.extra[{short_repr(key)}]")
    return TrajectoryMeta(
        env=expect_str(fields["env"], f"{where}.env"),
        seed=expect_optional_int(fields["seed"], f"{where}.seed"),
        model_version=expect_optional_int(fields["model_version"], f"{where}.model_version"),
        extra=extra,
    )


def _decode_call(obj: object, where: str, nodes: NodeTable, budget: Budget, version: int) -> CallRecord:
    if version < SAMPLING_VERSION and isinstance(obj, dict) and "versions" in obj:
        raise TreeFormatError(
            f"{where}.versions: a version {version} file has no such field (version {SAMPLING_VERSION} added it)"
        )
    fields = expect_fields(obj, where, ("end", "segment_lengths", "logprobs"), ("versions",))
    end = expect_int(fields["end"], f"{where}.end")
    if not 1 <= end < len(nodes.parents):
        raise TreeFormatError(f"{where}.end: {end} is not a node index in [1, {len(nodes.parents) - 1}]")
    budget.charge(nodes.ends[end], f"{where}.end")
    path_len = nodes.ends[end]
    raw_lengths = expect_array(fields["segment_lengths"], f"{where}.segment_lengths", min_len=1)
    lengths = tuple(
        expect_int(x, f"{where}.segment_lengths[{si}]", lo=1, hi=path_len) for si, x in enumerate(raw_lengths)
    )
    if sum(lengths) != path_len:
        raise TreeFormatError(
            f"{where}.segment_lengths: they sum to {sum(lengths)} but the path to nodes[{end}] has {path_len} tokens"
        )
    seg_codes = _segment_codes(nodes, end, lengths)
    if seg_codes is None:
        _explain_mixed_segment(nodes, end, lengths, where)
    assert seg_codes is not None
    policy_segments = [si for si, c in enumerate(seg_codes) if c == POLICY]
    if policy_segments and policy_segments[0] == 0:
        raise TreeFormatError(
            f"{where}.segment_lengths[0]: the call starts with a policy segment; a sequence's first token is "
            "never predicted, so it cannot carry loss"
        )
    logprobs = _call_logprobs(fields, where, lengths, policy_segments)
    versions = (
        _call_versions(fields["versions"], f"{where}.versions", len(policy_segments))
        if "versions" in fields
        else ()
    )
    return CallRecord(end, lengths, logprobs, versions)


def _call_versions(obj: object, where: str, n_policy: int) -> tuple[int | None, ...]:
    """One weight version (an int in [0, 2**63), or nil) per policy segment; never all nil, since the writer
    leaves the field out then, so a file that loads is written back byte for byte."""
    raw = expect_array(obj, where)
    if len(raw) != n_policy:
        raise TreeFormatError(
            f"{where}: {len(raw)} entries but the call has {n_policy} policy segments (one weight version per "
            "policy segment, or nil where unknown)"
        )
    out = tuple(
        None if v is None else expect_int(v, f"{where}[{j}]", 0, VERSION_LIMIT) for j, v in enumerate(raw)
    )
    if all(v is None for v in out):
        raise TreeFormatError(
            f"{where}: holds no version (every entry nil); leave the field out when none is known"
        )
    return out


def _segment_codes(nodes: NodeTable, end: int, lengths: tuple[int, ...]) -> list[int] | None:
    """The role code of each segment, or None when a segment mixes roles. Time is O(segments): a valid
    call has at most one role change per segment boundary, and only changes are visited."""
    changes = nodes.path_changes(end, len(lengths) - 1)
    if changes is None:
        return None
    out: list[int] = []
    code, k, pos = nodes.first_code[end], 0, 0
    for length in lengths:
        if k < len(changes) and changes[k][0] == pos:
            code = changes[k][1]
            k += 1
        if k < len(changes) and changes[k][0] < pos + length:
            return None
        out.append(code)
        pos += length
    return out


def _explain_mixed_segment(nodes: NodeTable, end: int, lengths: tuple[int, ...], where: str) -> None:
    """Raise naming the first segment that mixes roles (error path only: linear in the path once)."""
    codes = b"".join(nodes.role_codes[i] for i in nodes.path(end))
    pos = 0
    for si, length in enumerate(lengths):
        seg = codes[pos : pos + length]
        if seg.count(seg[0]) != length:
            k = next(j for j, c in enumerate(seg) if c != seg[0])
            raise TreeFormatError(
                f"{where}.segment_lengths[{si}]: the segment at positions {pos}..{pos + length - 1} mixes roles "
                f"({ROLES[seg[0]].value} at {pos}, {ROLES[seg[k]].value} at {pos + k})"
            )
        pos += length
    raise AssertionError("no mixed segment found on the slow path")


def _call_logprobs(
    fields: dict[str, object], where: str, lengths: tuple[int, ...], policy_segments: list[int]
) -> tuple[tuple[float, ...] | None, ...]:
    raw_lps = expect_array(fields["logprobs"], f"{where}.logprobs")
    if len(raw_lps) != len(policy_segments):
        raise TreeFormatError(
            f"{where}.logprobs: {len(raw_lps)} entries but the call has {len(policy_segments)} policy segments "
            "(one entry per policy segment; other roles carry no logprobs)"
        )
    return tuple(
        _decode_logprobs(lp, f"{where}.logprobs[{j}]", lengths[si])
        for j, (si, lp) in enumerate(zip(policy_segments, raw_lps))
    )


def _decode_logprobs(obj: object, where: str, length: int) -> tuple[float, ...] | None:
    if obj is None:
        return None
    raw = expect_bin(obj, where)
    if len(raw) != 8 * length:
        raise TreeFormatError(
            f"{where}: {len(raw)} bytes, but the policy segment has {length} tokens ({8 * length} expected)"
        )
    values = np.frombuffer(raw, dtype="<f8")
    bad = ~(np.isfinite(values) & (values <= 0.0))
    if bad.any():
        k = int(np.argmax(bad))
        raise TreeFormatError(f"{where}[{k}]: {float(values[k])!r} is not a finite log-probability <= 0")
    return tuple(values.tolist())


def _reward(obj: object, where: str) -> float:
    """A finite reward within the trajectory model's `REWARD_LIMIT`."""
    value = expect_finite(obj, where)
    if abs(value) > REWARD_LIMIT:
        raise TreeFormatError(
            f"{where}: {value!r} is outside +-{REWARD_LIMIT:g}, the largest reward accepted"
        )
    return value
