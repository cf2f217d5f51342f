"""The validating reader of tree files: untrusted bytes in, `TrajectoryTree`s or a `TreeFormatError` out.

Nothing is trusted. msgpack runs with size limits (a declared length can never exceed the limit or the
bytes present), ext types and duplicate map keys are refused, and every field is checked for type,
length and range before it is used. The node list must be exactly what `TrajectoryTree.build` produces
from the stored trajectories: one empty root at index 0, parents before children, depth-first pre-order
with siblings sorted by their first (token, role), and every node a maximal run. So a file that loads
always equals the tree rebuilt from its own trajectories, and node ids and the tree id are recomputed,
never taken on trust; stored ids must match.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import msgpack
import numpy as np

from treetrain.trajectory import Role, TrajectoryError, TrajectoryMeta
from treetrain.tree.model import ROOT_ID, CallRecord, CallRef, Node, TrajectoryRecord, TrajectoryTree, node_id
from treetrain.tree.schema import FORMAT_NAME, SUPPORTED_VERSIONS, Limits, TreeFormatError

_ROLES = tuple(Role.from_code(c) for c in range(len(Role)))
_VALID_CODES = bytes(range(len(_ROLES)))
_POLICY = Role.POLICY.code
_KNOWN_CODES = ", ".join(f"{r.code} {r.value}" for r in _ROLES)
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1


class _Rejected(Exception):
    """Raised from inside msgpack hooks; turned into a TreeFormatError by `_unpack`."""


def _no_ext(code: int, data: bytes) -> object:
    raise _Rejected(f"msgpack ext type {code} is not allowed in tree files")


def _unique_keys(pairs: Sequence[tuple[object, object]]) -> dict[object, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[object] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Rejected(f"duplicate map key {k!r}")
            seen.add(k)
    return out


def _unpack(data: bytes, limits: Limits) -> object:
    n = len(data)
    if n == 0:
        raise TreeFormatError("file: empty")
    if n > limits.max_file_bytes:
        raise TreeFormatError(f"file: {n} bytes exceeds the limit of {limits.max_file_bytes}")
    unpacker = msgpack.Unpacker(
        None,
        use_list=True,
        raw=False,
        strict_map_key=True,
        object_pairs_hook=_unique_keys,
        ext_hook=_no_ext,
        max_buffer_size=n,
        max_str_len=min(limits.max_str_bytes, n),
        max_bin_len=min(limits.max_bin_bytes, n),
        max_array_len=min(limits.max_array_len, n),
        max_map_len=min(limits.max_map_len, n // 2),
        max_ext_len=0,
    )
    try:
        unpacker.feed(data)
        obj = unpacker.unpack()
    except msgpack.OutOfData:
        raise TreeFormatError(
            "file: ends early (truncated, or a declared length is longer than the data or the limits)"
        ) from None
    except _Rejected as e:
        raise TreeFormatError(f"file: {e}") from None
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise TreeFormatError(f"file: not a valid msgpack document ({e})") from None
    if unpacker.tell() != n:
        raise TreeFormatError(
            f"file: {n - unpacker.tell()} bytes of trailing data after the msgpack document"
        )
    return obj


# ----- typed field access -----------------------------------------------------------------------------
def _kind(obj: object) -> str:
    names = {type(None): "nil", bool: "bool", int: "int", float: "float", str: "str", bytes: "bin"}
    names.update({list: "array", dict: "map"})
    return names.get(type(obj), type(obj).__name__)


def _fields(
    obj: object, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, object]:
    if not isinstance(obj, dict):
        raise TreeFormatError(f"{where}: expected a map, got {_kind(obj)}")
    for key in required:
        if key not in obj:
            raise TreeFormatError(f"{where}: missing field {key!r}")
    for key in obj:
        if key not in required and key not in optional:
            known = ", ".join(required + optional)
            raise TreeFormatError(f"{where}: unknown field {key!r} (known: {known})")
    return obj


def _int(obj: object, where: str, lo: int = _INT64_MIN, hi: int = _UINT64_MAX) -> int:
    if isinstance(obj, bool) or not isinstance(obj, int):
        raise TreeFormatError(f"{where}: expected an int, got {_kind(obj)}")
    if not lo <= obj <= hi:
        raise TreeFormatError(f"{where}: {obj} is out of range [{lo}, {hi}]")
    return obj


def _optional_int(obj: object, where: str) -> int | None:
    return None if obj is None else _int(obj, where)


def _finite(obj: object, where: str) -> float:
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        raise TreeFormatError(f"{where}: expected a number, got {_kind(obj)}")
    value = float(obj)
    if not math.isfinite(value):
        raise TreeFormatError(f"{where}: {value!r} is not finite")
    return value


def _str(obj: object, where: str) -> str:
    if not isinstance(obj, str):
        raise TreeFormatError(f"{where}: expected a str, got {_kind(obj)}")
    return obj


def _bin(obj: object, where: str) -> bytes:
    if not isinstance(obj, bytes):
        raise TreeFormatError(f"{where}: expected bin (bytes), got {_kind(obj)}")
    return obj


def _array(obj: object, where: str, min_len: int = 0) -> list[object]:
    if not isinstance(obj, list):
        raise TreeFormatError(f"{where}: expected an array, got {_kind(obj)}")
    if len(obj) < min_len:
        raise TreeFormatError(f"{where}: needs at least {min_len} element(s), got {len(obj)}")
    return obj


# ----- document ---------------------------------------------------------------------------------------
def decode_trees(data: bytes, limits: Limits) -> tuple[TrajectoryTree, ...]:
    """Parse and validate a whole file; the trees of its group, in file order."""
    top = _unpack(data, limits)
    if not isinstance(top, dict):
        raise TreeFormatError(f"file: expected a map at the top level, got {_kind(top)}")
    if top.get("format") != FORMAT_NAME:
        raise TreeFormatError(f"file.format: {top.get('format')!r} is not {FORMAT_NAME!r}; not a tree file")
    if "version" not in top:
        raise TreeFormatError("file: missing field 'version'")
    version = _int(top["version"], "file.version")
    if version not in SUPPORTED_VERSIONS:
        newest = max(SUPPORTED_VERSIONS)
        hint = "; written by a newer treetrain? upgrade" if version > newest else ""
        raise TreeFormatError(f"file.version: {version} is not supported (this reader knows {newest}){hint}")
    fields = _fields(top, "file", ("format", "version", "trees"))
    raw_trees = _array(fields["trees"], "trees", min_len=1)
    return tuple(_decode_tree(t, f"trees[{k}]") for k, t in enumerate(raw_trees))


def _decode_tree(obj: object, where: str) -> TrajectoryTree:
    fields = _fields(obj, where, ("nodes", "trajectories"), ("id",))
    nodes = _Nodes(_array(fields["nodes"], f"{where}.nodes", min_len=1), f"{where}.nodes")
    raw_trajs = _array(fields["trajectories"], f"{where}.trajectories", min_len=1)
    records: list[TrajectoryRecord] = []
    first_with_id: dict[str, int] = {}
    for ti, raw in enumerate(raw_trajs):
        rec = _decode_trajectory(raw, f"{where}.trajectories[{ti}]", nodes)
        if rec.id in first_with_id:
            raise TreeFormatError(
                f"{where}.trajectories[{ti}].id: {rec.id!r} duplicates trajectories[{first_with_id[rec.id]}].id"
            )
        first_with_id[rec.id] = ti
        records.append(rec)
    tree = TrajectoryTree(nodes.freeze(records), records)
    for ti in range(len(records)):
        try:
            tree.trajectory(ti)
        except TrajectoryError as e:
            raise TreeFormatError(f"{where}.trajectories[{ti}]: {e}") from None
    if "id" in fields and _str(fields["id"], f"{where}.id") != tree.id:
        raise TreeFormatError(f"{where}.id: stored {fields['id']!r} but the content hash is {tree.id!r}")
    return tree


class _Nodes:
    """The node list, checked field by field and then for canonical (radix, pre-order) structure."""

    def __init__(self, raw_nodes: list[object], where: str) -> None:
        self.where = where
        self.parents: list[int | None] = []
        self.tokens: list[tuple[int, ...]] = []
        self.role_codes: list[bytes] = []
        self.ids: list[str] = []
        self.offsets: list[int] = []
        self.ends: list[int] = []
        self.children: list[list[int]] = []
        for i, raw in enumerate(raw_nodes):
            self._add(i, raw)
        self._check_preorder()

    def _add(self, i: int, raw: object) -> None:
        w = f"{self.where}[{i}]"
        fields = _fields(raw, w, ("parent", "tokens", "roles"), ("id",))
        raw_parent = fields["parent"]
        parent: int | None = None
        if i == 0 and raw_parent is not None:
            raise TreeFormatError(f"{w}.parent: the root (node 0) must have parent nil, got {raw_parent!r}")
        if i > 0:
            if raw_parent is None:
                raise TreeFormatError(f"{w}.parent: nil, but only node 0 may be a root (a tree has one root)")
            parent = _int(raw_parent, f"{w}.parent")
            if not 0 <= parent < i:
                raise TreeFormatError(f"{w}.parent: {parent} is not a valid parent index (must be < {i})")
        tok_bytes = _bin(fields["tokens"], f"{w}.tokens")
        if len(tok_bytes) % 4:
            raise TreeFormatError(f"{w}.tokens: {len(tok_bytes)} bytes is not a whole number of uint32 ids")
        n = len(tok_bytes) // 4
        codes = _bin(fields["roles"], f"{w}.roles")
        if len(codes) != n:
            raise TreeFormatError(f"{w}.roles: {len(codes)} role codes for {n} tokens")
        if i == 0 and n:
            raise TreeFormatError(f"{w}.tokens: the root (node 0) must have no tokens, got {n}")
        if i > 0 and n == 0:
            raise TreeFormatError(f"{w}.tokens: empty, but only the root may have no tokens")
        if codes.translate(None, _VALID_CODES):
            pos = next(k for k, c in enumerate(codes) if c not in _VALID_CODES)
            raise TreeFormatError(f"{w}.roles[{pos}]: unknown role code {codes[pos]} (known: {_KNOWN_CODES})")
        tokens = tuple(np.frombuffer(tok_bytes, dtype="<u4").tolist())
        if parent is None:
            nid, offset = ROOT_ID, 0
        else:
            nid, offset = node_id(self.ids[parent], tokens, self.roles(codes)), self.ends[parent]
            self.children[parent].append(i)
        if "id" in fields and _str(fields["id"], f"{w}.id") != nid:
            raise TreeFormatError(f"{w}.id: stored {fields['id']!r} but the content hash is {nid!r}")
        self.parents.append(parent)
        self.tokens.append(tokens)
        self.role_codes.append(codes)
        self.ids.append(nid)
        self.offsets.append(offset)
        self.ends.append(offset + n)
        self.children.append([])

    @staticmethod
    def roles(codes: bytes) -> tuple[Role, ...]:
        return tuple(map(_ROLES.__getitem__, codes))

    def _check_preorder(self) -> None:
        for i, kids in enumerate(self.children):
            for a, b in itertools.pairwise(kids):
                ka, kb = (
                    (self.tokens[a][0], self.role_codes[a][0]),
                    (self.tokens[b][0], self.role_codes[b][0]),
                )
                if not ka < kb:
                    raise TreeFormatError(
                        f"{self.where}[{b}]: starts with (token, role code) {kb}, which does not sort after its "
                        f"earlier sibling nodes[{a}]'s {ka}; children of nodes[{i}] must start with distinct "
                        "pairs in increasing order"
                    )
        stack, k = [0], 0
        while stack:
            v = stack.pop()
            if v != k:
                raise TreeFormatError(
                    f"{self.where}[{v}]: not in depth-first pre-order (a pre-order walk reaches it at index {k})"
                )
            k += 1
            stack.extend(reversed(self.children[v]))

    def path(self, index: int) -> list[int]:
        out: list[int] = []
        cur: int | None = index
        while cur is not None:
            out.append(cur)
            cur = self.parents[cur]
        out.reverse()
        return out

    def freeze(self, records: Sequence[TrajectoryRecord]) -> list[Node]:
        """Attach call ends and trajectory sets, check every node is a maximal run, build `Node`s."""
        ends_at: list[list[CallRef]] = [[] for _ in self.parents]
        through: list[set[int]] = [set() for _ in self.parents]
        for ti, rec in enumerate(records):
            for ci, call in enumerate(rec.calls):
                ends_at[call.end].append(CallRef(ti, ci))
                cur: int | None = call.end
                while cur is not None and ti not in through[cur]:
                    through[cur].add(ti)
                    cur = self.parents[cur]
        for i in range(1, len(self.parents)):
            kids = self.children[i]
            if not kids and not ends_at[i]:
                raise TreeFormatError(f"{self.where}[{i}]: a leaf at which no call ends")
            if len(kids) == 1 and not ends_at[i]:
                raise TreeFormatError(
                    f"{self.where}[{i}]: one child (nodes[{kids[0]}]) and no call ending here; "
                    "the two are one maximal run and must be stored as one node"
                )
        return [
            Node(
                i,
                self.ids[i],
                self.parents[i],
                tuple(self.children[i]),
                self.tokens[i],
                self.roles(self.role_codes[i]),
                self.offsets[i],
                frozenset(through[i]),
                tuple(ends_at[i]),
            )
            for i in range(len(self.parents))
        ]


# ----- trajectories -----------------------------------------------------------------------------------
def _decode_trajectory(obj: object, where: str, nodes: _Nodes) -> TrajectoryRecord:
    fields = _fields(obj, where, ("id", "reward", "step_rewards", "meta", "calls"))
    tid = _str(fields["id"], f"{where}.id")
    if not tid:
        raise TreeFormatError(f"{where}.id: empty; trajectory ids must be non-empty")
    reward = _finite(fields["reward"], f"{where}.reward")
    raw_steps = _array(fields["step_rewards"], f"{where}.step_rewards")
    steps = tuple(_finite(x, f"{where}.step_rewards[{j}]") for j, x in enumerate(raw_steps))
    meta = _decode_meta(fields["meta"], f"{where}.meta")
    raw_calls = _array(fields["calls"], f"{where}.calls", min_len=1)
    calls = tuple(_decode_call(c, f"{where}.calls[{ci}]", nodes) for ci, c in enumerate(raw_calls))
    n_policy = sum(len(c.logprobs) for c in calls)
    if steps and len(steps) != n_policy:
        raise TreeFormatError(
            f"{where}.step_rewards: {len(steps)} entries but the trajectory has {n_policy} policy segments "
            "(give one per policy segment, or none)"
        )
    return TrajectoryRecord(tid, reward, steps, meta, calls)


def _decode_meta(obj: object, where: str) -> TrajectoryMeta:
    fields = _fields(obj, where, ("env", "seed", "model_version", "extra"))
    raw_extra = fields["extra"]
    if not isinstance(raw_extra, dict):
        raise TreeFormatError(f"{where}.extra: expected a map, got {_kind(raw_extra)}")
    extra: dict[str, str] = {}
    for k, v in raw_extra.items():
        key = _str(k, f"{where}.extra key")
        extra[key] = _str(v, f"{where}.extra[{key!r}]")
    return TrajectoryMeta(
        env=_str(fields["env"], f"{where}.env"),
        seed=_optional_int(fields["seed"], f"{where}.seed"),
        model_version=_optional_int(fields["model_version"], f"{where}.model_version"),
        extra=extra,
    )


def _decode_call(obj: object, where: str, nodes: _Nodes) -> CallRecord:
    fields = _fields(obj, where, ("end", "segment_lengths", "logprobs"))
    end = _int(fields["end"], f"{where}.end")
    if not 1 <= end < len(nodes.parents):
        raise TreeFormatError(f"{where}.end: {end} is not a node index in [1, {len(nodes.parents) - 1}]")
    codes = b"".join(nodes.role_codes[i] for i in nodes.path(end))
    raw_lengths = _array(fields["segment_lengths"], f"{where}.segment_lengths", min_len=1)
    lengths = tuple(
        _int(x, f"{where}.segment_lengths[{si}]", lo=1, hi=len(codes)) for si, x in enumerate(raw_lengths)
    )
    if sum(lengths) != len(codes):
        raise TreeFormatError(
            f"{where}.segment_lengths: they sum to {sum(lengths)} but the path to nodes[{end}] has {len(codes)} tokens"
        )
    policy_segments: list[int] = []
    pos = 0
    for si, length in enumerate(lengths):
        seg = codes[pos : pos + length]
        if seg.count(seg[0]) != length:
            k = next(j for j, c in enumerate(seg) if c != seg[0])
            raise TreeFormatError(
                f"{where}.segment_lengths[{si}]: the segment at positions {pos}..{pos + length - 1} mixes roles "
                f"({_ROLES[seg[0]].value} at {pos}, {_ROLES[seg[k]].value} at {pos + k})"
            )
        if seg[0] == _POLICY:
            policy_segments.append(si)
        pos += length
    raw_lps = _array(fields["logprobs"], f"{where}.logprobs")
    if len(raw_lps) != len(policy_segments):
        raise TreeFormatError(
            f"{where}.logprobs: {len(raw_lps)} entries but the call has {len(policy_segments)} policy segments "
            "(one entry per policy segment; other roles carry no logprobs)"
        )
    logprobs = tuple(
        _decode_logprobs(lp, f"{where}.logprobs[{j}]", lengths[si])
        for j, (si, lp) in enumerate(zip(policy_segments, raw_lps))
    )
    return CallRecord(end, lengths, logprobs)


def _decode_logprobs(obj: object, where: str, length: int) -> tuple[float, ...] | None:
    if obj is None:
        return None
    raw = _bin(obj, where)
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
