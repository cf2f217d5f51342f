"""The node list of a tree file, checked field by field and then for canonical structure.

Why its own module: the node list carries the tree's whole shape, and checking that it is exactly what
`build_tree` would produce (one root, parents first, depth-first pre-order, siblings sorted, maximal runs)
is most of the reader's work. It also records where roles change along each root path, so the reader can
check a call's segments in time proportional to its segments (`treetrain.tree.reader`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from treetrain.trajectory import Role
from treetrain.tree.schema import TreeFormatError
from treetrain.tree.trajectory_tree import ROOT_ID, CallRef, Node, TrajectoryRecord, node_id
from treetrain.tree.unpack import expect_bin, expect_fields, expect_int, expect_str, short_repr

ROLES = tuple(Role.from_code(c) for c in range(len(Role)))
VALID_CODES = bytes(range(len(ROLES)))
POLICY = Role.POLICY.code
KNOWN_CODES = ", ".join(f"{r.code} {r.value}" for r in ROLES)


class Budget:
    """Counts a quantity of the file being decoded against a limit; `what` says what it counts in the
    error. Two are used: T, the summed length of the calls decoded so far (`Limits.max_total_tokens`), and
    (node, trajectory) incidences, the entries of every `Node.trajectories` set, against a limit
    proportional to the file size (`Limits.node_visits_per_byte`).

    Loading does work and keeps memory in proportion to the file plus these incidences; a small file of
    one-token nodes under many trajectories (a deep comb) would otherwise hold a quadratic number."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.used = 0

    def charge(self, n: int, where: str) -> None:
        self.used += n
        if self.used > self.limit:
            raise TreeFormatError(self.what.format(where=where, used=self.used, limit=self.limit))


class NodeTable:
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
        # Role changes along each root path, so that a call's segments are checked in time proportional
        # to its segments, never to its path: `changes[i]` lists (position, new role code) inside node i
        # (its first token included when the role differs from the parent's last), `change_up[i]` is the
        # nearest node at or above i with a change, `n_changes[i]` counts changes from the root to i.
        self.first_code: list[int] = []
        self.last_code: list[int] = []
        self.changes: list[tuple[tuple[int, int], ...]] = []
        self.change_up: list[int] = []
        self.n_changes: list[int] = []
        self.has_policy: list[bool] = []
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
        if codes.translate(None, VALID_CODES):
            pos = next(k for k, c in enumerate(codes) if c not in VALID_CODES)
            raise TreeFormatError(f"{w}.roles[{pos}]: unknown role code {codes[pos]} (known: {KNOWN_CODES})")
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
        self._add_changes(parent, codes, offset)
        self.parents.append(parent)
        self.tokens.append(tokens)
        self.role_codes.append(codes)
        self.ids.append(nid)
        self.offsets.append(offset)
        self.ends.append(offset + n)
        self.children.append([])

    def _add_changes(self, parent: int | None, codes: bytes, offset: int) -> None:
        if parent is None:
            self.first_code.append(-1)
            self.last_code.append(-1)
            self.changes.append(())
            self.change_up.append(-1)
            self.n_changes.append(0)
            self.has_policy.append(False)
            return
        arr = np.frombuffer(codes, dtype=np.uint8)  # [n]
        inner = (np.flatnonzero(arr[1:] != arr[:-1]) + 1).tolist()
        changes = [(offset + k, codes[k]) for k in inner]
        if parent != 0 and self.last_code[parent] != codes[0]:
            changes.insert(0, (offset, codes[0]))
        self.first_code.append(codes[0] if parent == 0 else self.first_code[parent])
        self.last_code.append(codes[-1])
        self.changes.append(tuple(changes))
        self.change_up.append(len(self.changes) - 1 if changes else self.change_up[parent])
        self.n_changes.append(self.n_changes[parent] + len(changes))
        self.has_policy.append(self.has_policy[parent] or POLICY in codes)

    def path_changes(self, end: int, at_most: int) -> list[tuple[int, int]] | None:
        """Every role change on the path to `end`, in order; None when there are more than `at_most`."""
        if self.n_changes[end] > at_most:
            return None
        out: list[tuple[int, int]] = []
        cur = self.change_up[end]
        while cur > 0:
            out.extend(reversed(self.changes[cur]))
            parent = self.parents[cur]
            assert parent is not None
            cur = self.change_up[parent]
        out.reverse()
        return out

    @staticmethod
    def roles(codes: bytes) -> tuple[Role, ...]:
        return tuple(map(ROLES.__getitem__, codes))

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

    def freeze(self, records: Sequence[TrajectoryRecord], visits: Budget, tree_where: str) -> list[Node]:
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
                    visits.used += 1
                if visits.used > visits.limit:
                    visits.charge(0, f"{tree_where}.trajectories[{ti}].calls[{ci}]")
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
