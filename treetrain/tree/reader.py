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

import itertools
from collections.abc import Sequence

import numpy as np

from treetrain.trajectory import Role, TrajectoryError, TrajectoryMeta
from treetrain.tree.model import ROOT_ID, CallRecord, CallRef, Node, TrajectoryRecord, TrajectoryTree, node_id
from treetrain.tree.schema import FORMAT_NAME, SUPPORTED_VERSIONS, Limits, TreeFormatError
from treetrain.tree.untrusted import (
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

_ROLES = tuple(Role.from_code(c) for c in range(len(Role)))
_VALID_CODES = bytes(range(len(_ROLES)))
_POLICY = Role.POLICY.code
_KNOWN_CODES = ", ".join(f"{r.code} {r.value}" for r in _ROLES)


# ----- document ---------------------------------------------------------------------------------------
def decode_trees(data: bytes, limits: Limits) -> tuple[TrajectoryTree, ...]:
    """Parse and validate a whole file; the trees of its group, in file order."""
    top = unpack_limited(data, limits)
    if not isinstance(top, dict):
        raise TreeFormatError(f"file: expected a map at the top level, got {kind(top)}")
    if top.get("format") != FORMAT_NAME:
        raise TreeFormatError(
            f"file.format: {short_repr(top.get('format'))} is not {FORMAT_NAME!r}; not a tree file"
        )
    if "version" not in top:
        raise TreeFormatError("file: missing field 'version'")
    version = expect_int(top["version"], "file.version")
    if version not in SUPPORTED_VERSIONS:
        newest = max(SUPPORTED_VERSIONS)
        hint = "; written by a newer treetrain? upgrade" if version > newest else ""
        raise TreeFormatError(f"file.version: {version} is not supported (this reader knows {newest}){hint}")
    fields = expect_fields(top, "file", ("format", "version", "trees"))
    raw_trees = expect_array(fields["trees"], "trees", min_len=1)
    budget = _TokenBudget(limits.max_total_tokens)
    return tuple(_decode_tree(t, f"trees[{k}]", budget) for k, t in enumerate(raw_trees))


class _TokenBudget:
    """Counts T, the summed length of the calls decoded so far, against `Limits.max_total_tokens`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def charge(self, n: int, where: str) -> None:
        self.used += n
        if self.used > self.limit:
            raise TreeFormatError(
                f"{where}: the calls so far hold {self.used} tokens in total, over the limit of {self.limit}"
            )


def _decode_tree(obj: object, where: str, budget: _TokenBudget) -> TrajectoryTree:
    fields = expect_fields(obj, where, ("nodes", "trajectories"), ("id",))
    nodes = _Nodes(expect_array(fields["nodes"], f"{where}.nodes", min_len=1), f"{where}.nodes")
    raw_trajs = expect_array(fields["trajectories"], f"{where}.trajectories", min_len=1)
    records: list[TrajectoryRecord] = []
    first_with_id: dict[str, int] = {}
    for ti, raw in enumerate(raw_trajs):
        rec = _decode_trajectory(raw, f"{where}.trajectories[{ti}]", nodes, budget)
        if rec.id in first_with_id:
            raise TreeFormatError(
                f"{where}.trajectories[{ti}].id: {short_repr(rec.id)} duplicates trajectories[{first_with_id[rec.id]}].id"
            )
        first_with_id[rec.id] = ti
        records.append(rec)
    tree = TrajectoryTree(nodes.freeze(records), records)
    for ti in range(len(records)):
        try:
            tree.trajectory(ti)
        except TrajectoryError as e:
            raise TreeFormatError(f"{where}.trajectories[{ti}]: {e}") from None
    if "id" in fields and expect_str(fields["id"], f"{where}.id") != tree.id:
        raise TreeFormatError(
            f"{where}.id: stored {short_repr(fields['id'])} but the content hash is {tree.id!r}"
        )
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
        fields = expect_fields(raw, w, ("parent", "tokens", "roles"), ("id",))
        raw_parent = fields["parent"]
        parent: int | None = None
        if i == 0 and raw_parent is not None:
            raise TreeFormatError(
                f"{w}.parent: the root (node 0) must have parent nil, got {short_repr(raw_parent)}"
            )
        if i > 0:
            if raw_parent is None:
                raise TreeFormatError(f"{w}.parent: nil, but only node 0 may be a root (a tree has one root)")
            parent = expect_int(raw_parent, f"{w}.parent")
            if not 0 <= parent < i:
                raise TreeFormatError(f"{w}.parent: {parent} is not a valid parent index (must be < {i})")
        tok_bytes = expect_bin(fields["tokens"], f"{w}.tokens")
        if len(tok_bytes) % 4:
            raise TreeFormatError(f"{w}.tokens: {len(tok_bytes)} bytes is not a whole number of uint32 ids")
        n = len(tok_bytes) // 4
        codes = expect_bin(fields["roles"], f"{w}.roles")
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
        if "id" in fields and expect_str(fields["id"], f"{w}.id") != nid:
            raise TreeFormatError(
                f"{w}.id: stored {short_repr(fields['id'])} but the content hash is {nid!r}"
            )
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
def _decode_trajectory(obj: object, where: str, nodes: _Nodes, budget: _TokenBudget) -> TrajectoryRecord:
    fields = expect_fields(obj, where, ("id", "reward", "step_rewards", "meta", "calls"))
    tid = expect_str(fields["id"], f"{where}.id")
    if not tid:
        raise TreeFormatError(f"{where}.id: empty; trajectory ids must be non-empty")
    reward = expect_finite(fields["reward"], f"{where}.reward")
    raw_steps = expect_array(fields["step_rewards"], f"{where}.step_rewards")
    steps = tuple(expect_finite(x, f"{where}.step_rewards[{j}]") for j, x in enumerate(raw_steps))
    meta = _decode_meta(fields["meta"], f"{where}.meta")
    raw_calls = expect_array(fields["calls"], f"{where}.calls", min_len=1)
    calls = tuple(_decode_call(c, f"{where}.calls[{ci}]", nodes, budget) for ci, c in enumerate(raw_calls))
    n_policy = sum(len(c.logprobs) for c in calls)
    if steps and len(steps) != n_policy:
        raise TreeFormatError(
            f"{where}.step_rewards: {len(steps)} entries but the trajectory has {n_policy} policy segments "
            "(give one per policy segment, or none)"
        )
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


def _decode_call(obj: object, where: str, nodes: _Nodes, budget: _TokenBudget) -> CallRecord:
    fields = expect_fields(obj, where, ("end", "segment_lengths", "logprobs"))
    end = expect_int(fields["end"], f"{where}.end")
    if not 1 <= end < len(nodes.parents):
        raise TreeFormatError(f"{where}.end: {end} is not a node index in [1, {len(nodes.parents) - 1}]")
    budget.charge(nodes.ends[end], f"{where}.end")
    codes = b"".join(nodes.role_codes[i] for i in nodes.path(end))
    raw_lengths = expect_array(fields["segment_lengths"], f"{where}.segment_lengths", min_len=1)
    lengths = tuple(
        expect_int(x, f"{where}.segment_lengths[{si}]", lo=1, hi=len(codes))
        for si, x in enumerate(raw_lengths)
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
    raw_lps = expect_array(fields["logprobs"], f"{where}.logprobs")
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
