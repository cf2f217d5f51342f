"""Radix merge of trajectories into a `TrajectoryTree`.

Every call is one sequence of (token id, role) pairs. Sequences are inserted into a radix tree; a node is
split wherever two sequences part ways or where one ends inside it, so every call ends on a node
boundary. Children are ordered by their first (token, role), which makes node order a function of the
set of sequences alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from treetrain.trajectory import Role, Segment, Trajectory, TrajectoryError
from treetrain.tree.trajectory_tree import (
    ROOT_ID,
    CallRecord,
    CallRef,
    Node,
    SamplingRecord,
    TrajectoryRecord,
    TrajectoryTree,
    node_id,
)


@dataclass
class _Draft:
    tokens: list[int]
    roles: list[Role]
    children: dict[tuple[int, int], _Draft] = field(default_factory=dict)
    ends: list[CallRef] = field(default_factory=list)

    def split(self, at: int) -> None:
        """Keep the first `at` pairs here and move the rest into a single new child."""
        tail = _Draft(self.tokens[at:], self.roles[at:], self.children, self.ends)
        self.tokens, self.roles = self.tokens[:at], self.roles[:at]
        self.children = {(tail.tokens[0], tail.roles[0].code): tail}
        self.ends = []


def _insert(root: _Draft, tokens: tuple[int, ...], roles: tuple[Role, ...], ref: CallRef) -> None:
    node, i, n = root, 0, len(tokens)
    while i < n:
        key = (tokens[i], roles[i].code)
        child = node.children.get(key)
        if child is None:
            child = _Draft(list(tokens[i:]), list(roles[i:]))
            node.children[key] = child
            child.ends.append(ref)
            return
        m, limit = 0, min(len(child.tokens), n - i)
        while m < limit and child.tokens[m] == tokens[i + m] and child.roles[m] is roles[i + m]:
            m += 1
        if m < len(child.tokens):
            child.split(m)
        node, i = child, i + m
    node.ends.append(ref)


def _versions(segments: tuple[Segment, ...]) -> tuple[int | None, ...]:
    """One weight version per policy segment, or () when none is known (so unversioned data stays as it was)."""
    versions = tuple(s.version for s in segments if s.role is Role.POLICY)
    return versions if any(v is not None for v in versions) else ()


def build_tree(trajectories: Iterable[Trajectory], sampling: SamplingRecord | None = None) -> TrajectoryTree:
    """Merge trajectories into one tree. Trajectory ids must be unique. `sampling` says how they were
    sampled, when known (the rollout records it)."""
    trajs = list(trajectories)
    if not trajs:
        raise TrajectoryError("cannot build a tree from zero trajectories")
    seen: set[str] = set()
    root = _Draft([], [])
    records: list[TrajectoryRecord] = []
    for ti, traj in enumerate(trajs):
        if not isinstance(traj, Trajectory):
            raise TrajectoryError(f"item {ti} is {type(traj).__name__}, not a Trajectory")
        if traj.id in seen:
            raise TrajectoryError(f"duplicate trajectory id {traj.id!r}")
        seen.add(traj.id)
        for ci, call in enumerate(traj.calls):
            _insert(root, call.tokens, call.roles, CallRef(ti, ci))

    nodes: list[Node] = []
    end_of: dict[CallRef, int] = {}
    # Iterative pre-order so deep trees do not hit the recursion limit.
    stack: list[tuple[_Draft, int | None, str, int]] = [(root, None, "", 0)]
    pending_children: dict[int, list[int]] = {}
    while stack:
        draft, parent, parent_id, offset = stack.pop()
        index = len(nodes)
        nid = ROOT_ID if parent is None else node_id(parent_id, draft.tokens, draft.roles)
        nodes.append(
            Node(index, nid, parent, (), tuple(draft.tokens), tuple(draft.roles), offset, frozenset(), ())
        )
        pending_children[index] = []
        if parent is not None:
            pending_children[parent].append(index)
        for ref in draft.ends:
            end_of[ref] = index
        end = offset + len(draft.tokens)
        for key in sorted(draft.children, reverse=True):
            stack.append((draft.children[key], index, nid, end))

    trajs_through: list[set[int]] = [set() for _ in nodes]
    ends: list[list[CallRef]] = [[] for _ in nodes]
    for ref, idx in end_of.items():
        ends[idx].append(ref)
        cur: int | None = idx
        while cur is not None:
            if ref.trajectory in trajs_through[cur]:
                break
            trajs_through[cur].add(ref.trajectory)
            cur = nodes[cur].parent
    frozen = [
        Node(
            n.index,
            n.id,
            n.parent,
            tuple(pending_children[n.index]),
            n.tokens,
            n.roles,
            n.offset,
            frozenset(trajs_through[n.index]),
            tuple(sorted(ends[n.index], key=lambda r: (r.trajectory, r.call))),
        )
        for n in nodes
    ]

    for ti, traj in enumerate(trajs):
        calls = tuple(
            CallRecord(
                end=end_of[CallRef(ti, ci)],
                segment_lengths=tuple(len(s) for s in call.segments),
                logprobs=tuple(s.logprobs for s in call.segments if s.role is Role.POLICY),
                versions=_versions(call.segments),
            )
            for ci, call in enumerate(traj.calls)
        )
        records.append(TrajectoryRecord(traj.id, traj.reward, traj.step_rewards, traj.meta, calls))
    return TrajectoryTree(frozen, records, sampling)
