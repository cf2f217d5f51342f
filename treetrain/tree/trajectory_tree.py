"""The trajectory tree: a radix tree over (token id, role) with content-addressed nodes.

Node 0 is always an empty *root* sentinel, so a tree whose calls start with different tokens still has one
root. Every other node is a maximal run of (token, role) pairs shared by the same set of calls. A node's id
is a hash of its parent's id, its tokens and its roles, so equal prefixes get equal ids in any tree, and
text equality never merges anything: tokenization is never redone.

Per-trajectory data that is not shared (reward, step rewards, metadata, segment boundaries, sampler
logprobs) lives in `TrajectoryRecord`s, which together with the nodes reconstruct every input exactly. A
tree sampled by treetrain also says how (`SamplingRecord`): the trainer scores at the sampling temperature,
so training on a recorded tree checks it.

Example:
    >>> from treetrain.trajectory import Call, Role, Segment, Trajectory
    >>> def traj(i, resp):
    ...     call = Call((Segment(Role.PROMPT, (1, 2, 3)), Segment(Role.POLICY, resp)))
    ...     return Trajectory(id=f"t{i}", calls=(call,), reward=float(i))
    >>> from treetrain.tree.build import build_tree
    >>> tree = build_tree([traj(0, (7, 8)), traj(1, (7, 9))])
    >>> [len(n.tokens) for n in tree.nodes], tree.divergence_points()
    ([0, 4, 1, 1], (1,))
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

from treetrain.trajectory import Call, Role, Segment, Trajectory, TrajectoryError, TrajectoryMeta

ROOT = 0


@dataclass(frozen=True)
class CallRef:
    """Which call of which trajectory (indices into `TrajectoryTree.records`)."""

    trajectory: int
    call: int


@dataclass(frozen=True)
class Node:
    """A maximal run of (token, role) pairs shared by the same set of calls.

    `offset` is the absolute position of the node's first token in every sequence through it.
    `trajectories` is the set of trajectory indices whose calls pass through (or end at) this node.
    `ends` lists the calls that end exactly here (a call may end at an internal node when it is a
    prefix of another).
    """

    index: int
    id: str
    parent: int | None
    children: tuple[int, ...]
    tokens: tuple[int, ...]
    roles: tuple[Role, ...]
    offset: int
    trajectories: frozenset[int]
    ends: tuple[CallRef, ...]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_divergence(self) -> bool:
        return len(self.children) > 1

    @property
    def end(self) -> int:
        """Absolute position one past the node's last token."""
        return self.offset + len(self.tokens)


@dataclass(frozen=True)
class CallRecord:
    """How to rebuild one call: where its path ends, and what the nodes do not hold.

    `segment_lengths` restores segment boundaries (two adjacent policy segments stay two);
    `logprobs` has one entry per policy segment, in order: the sampler's logprobs, or None.
    `versions` has one entry per policy segment too, the weight version that sampled it or None; it is
    empty when no segment of the call records one (imported data, older files).
    """

    end: int
    segment_lengths: tuple[int, ...]
    logprobs: tuple[tuple[float, ...] | None, ...]
    versions: tuple[int | None, ...] = ()

    def version(self, policy_segment: int) -> int | None:
        """The weight version of the call's `policy_segment`-th policy segment, None when unknown."""
        return self.versions[policy_segment] if self.versions else None


@dataclass(frozen=True)
class SamplingRecord:
    """The settings a tree's policy tokens were drawn with, so its sampler logprobs can be read: they are of
    softmax(logits / temperature) restricted to the top-p nucleus and renormalised.

    Example:
        >>> SamplingRecord(temperature=0.7).describe()
        'temperature 0.7, top_p 1.0'
    """

    temperature: float
    """Softmax temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1] (1: the whole distribution)."""

    def __post_init__(self) -> None:  # errors name the field alone; the reader puts the tree in front
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise TrajectoryError(f"{name}: {value!r} is not a finite number")
        if self.temperature < 0:
            raise TrajectoryError(f"temperature: {self.temperature!r} is below 0")
        if not 0 < self.top_p <= 1:
            raise TrajectoryError(f"top_p: {self.top_p!r} is not in (0, 1]")

    def describe(self) -> str:
        return f"temperature {self.temperature}, top_p {self.top_p}"


@dataclass(frozen=True)
class TrajectoryRecord:
    """The unshared part of a trajectory."""

    id: str
    reward: float
    step_rewards: tuple[float, ...]
    meta: TrajectoryMeta
    calls: tuple[CallRecord, ...]


def node_id(parent_id: str, tokens: Sequence[int], roles: Sequence[Role]) -> str:
    """Content address of a node: sha256 over the parent id, the token ids and the role codes."""
    h = hashlib.sha256()
    h.update(parent_id.encode("ascii"))
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(array("Q", tokens).tobytes())
    h.update(bytes(r.code for r in roles))
    return h.hexdigest()[:32]


ROOT_ID = node_id("", (), ())


class TrajectoryTree:
    """An immutable prefix tree of trajectories.

    Build one with `treetrain.tree.build_tree`; its statistics are `treetrain.tree.tree_stats(tree)` and a
    networkx view is `treetrain.tree.graph.to_networkx(tree)`. Those live above this module, which holds
    only the data and its navigation, so the tree package depends one way: build/stats/graph -> model.
    `sampling` is how its policy tokens were drawn, None when unknown (imported, synthetic, older files); it
    is metadata, not content, and not part of `id`; so are the weight versions of the policy segments
    (`CallRecord.versions`, summarised per node by `node_versions`).
    """

    def __init__(
        self,
        nodes: Sequence[Node],
        records: Sequence[TrajectoryRecord],
        sampling: SamplingRecord | None = None,
    ) -> None:
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.records: tuple[TrajectoryRecord, ...] = tuple(records)
        self.sampling = sampling
        if not self.nodes or self.nodes[ROOT].parent is not None or self.nodes[ROOT].tokens:
            raise TrajectoryError("tree must start with an empty root node")

    # ----- identity ---------------------------------------------------------------------------------
    @cached_property
    def id(self) -> str:
        """Content hash of the whole tree: node ids, trajectory ids, rewards and call ends."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(n.id.encode("ascii"))
        for r in self.records:
            h.update(r.id.encode("utf-8") + b"\0")
            h.update(repr((r.reward, r.step_rewards, [c.end for c in r.calls])).encode("ascii"))
        return h.hexdigest()[:32]

    # ----- structure --------------------------------------------------------------------------------
    @property
    def root(self) -> Node:
        return self.nodes[ROOT]

    def __len__(self) -> int:
        return len(self.nodes)

    def path(self, index: int) -> tuple[int, ...]:
        """Node indices from the first real node down to `index` (the empty root excluded)."""
        out: list[int] = []
        cur: int | None = index
        while cur is not None and cur != ROOT:
            out.append(cur)
            cur = self.nodes[cur].parent
        return tuple(reversed(out))

    def ancestors(self, index: int) -> tuple[int, ...]:
        """Proper ancestors of `index`, root-side first, empty root excluded."""
        return self.path(index)[:-1]

    def leaves(self) -> tuple[int, ...]:
        return tuple(n.index for n in self.nodes if n.is_leaf and n.index != ROOT)

    def divergence_points(self) -> tuple[int, ...]:
        return tuple(n.index for n in self.nodes if n.is_divergence)

    def postorder(self) -> Iterator[int]:
        """Children before parents; the empty root last."""
        stack: list[tuple[int, bool]] = [(ROOT, False)]
        while stack:
            idx, expanded = stack.pop()
            if expanded:
                yield idx
                continue
            stack.append((idx, True))
            for c in reversed(self.nodes[idx].children):
                stack.append((c, False))

    def call_refs(self) -> tuple[CallRef, ...]:
        return tuple(CallRef(t, c) for t, r in enumerate(self.records) for c in range(len(r.calls)))

    def call_end(self, ref: CallRef) -> int:
        return self.records[ref.trajectory].calls[ref.call].end

    def call_tokens(self, ref: CallRef) -> tuple[tuple[int, ...], tuple[Role, ...]]:
        toks: list[int] = []
        roles: list[Role] = []
        for i in self.path(self.call_end(ref)):
            toks.extend(self.nodes[i].tokens)
            roles.extend(self.nodes[i].roles)
        return tuple(toks), tuple(roles)

    def owned_policy_tokens(self) -> tuple[int, ...]:
        """Per trajectory, its policy tokens counted once each (`Trajectory.num_policy_tokens`), read off the
        nodes it passes through: time linear in the nodes' trajectory sets, never in the calls' lengths."""
        out = [0] * len(self.records)
        for n in self.nodes:
            k = sum(1 for r in n.roles if r is Role.POLICY)
            if k:
                for ti in n.trajectories:
                    out[ti] += k
        return tuple(out)

    @cached_property
    def node_versions(self) -> tuple[tuple[int, ...], ...]:
        """Per node, the distinct weight versions that sampled its policy tokens, ascending.

        Versions are metadata, like logprobs: a node is its tokens and roles, so the same tokens sampled by
        two versions are one node recording both (and neither changes a node id or the tree id). Empty for
        nodes without policy tokens and where no version is recorded. Time is linear in the nodes on the
        calls' paths plus their segments, never in the calls' lengths.
        """
        found: list[set[int]] = [set() for _ in self.nodes]
        for rec in self.records:
            for crec in rec.calls:
                if any(v is not None for v in crec.versions):
                    self._add_call_versions(crec, found)
        return tuple(tuple(sorted(s)) for s in found)

    def _add_call_versions(self, crec: CallRecord, found: list[set[int]]) -> None:
        path = self.path(crec.end)
        k = pos = j = 0  # path[k] holds position `pos`; j counts policy segments
        for length in crec.segment_lengths:
            while self.nodes[path[k]].end <= pos:
                k += 1
            node = self.nodes[path[k]]
            if node.roles[pos - node.offset] is Role.POLICY:
                version = crec.version(j)
                j += 1
                m = k
                while version is not None and m < len(path) and self.nodes[path[m]].offset < pos + length:
                    found[path[m]].add(version)
                    m += 1
            pos += length

    # ----- reconstruction ---------------------------------------------------------------------------
    def trajectory(self, index: int) -> Trajectory:
        """Rebuild input trajectory `index` exactly (tokens, roles, segments, logprobs, rewards, meta)."""
        rec = self.records[index]
        calls = []
        for ci, crec in enumerate(rec.calls):
            toks, roles = self.call_tokens(CallRef(index, ci))
            segs: list[Segment] = []
            pos = j = 0
            for length in crec.segment_lengths:
                role = roles[pos]
                if role is Role.POLICY:
                    segs.append(Segment(role, toks[pos : pos + length], crec.logprobs[j], crec.version(j)))
                    j += 1
                else:
                    segs.append(Segment(role, toks[pos : pos + length]))
                pos += length
            calls.append(Call(tuple(segs)))
        return Trajectory(rec.id, tuple(calls), rec.reward, rec.step_rewards, rec.meta)

    def trajectories(self) -> tuple[Trajectory, ...]:
        return tuple(self.trajectory(i) for i in range(len(self.records)))

    def sampler_logprobs(self, ref: CallRef) -> tuple[float, ...] | None:
        """Per-position sampler logprobs of a call (NaN off policy), or None when any are missing."""
        crec = self.records[ref.trajectory].calls[ref.call]
        if any(lp is None for lp in crec.logprobs):
            return None
        _, roles = self.call_tokens(ref)
        out: list[float] = []
        it = (x for lp in crec.logprobs if lp is not None for x in lp)
        for r in roles:
            out.append(next(it) if r is Role.POLICY else math.nan)
        return tuple(out)

    def __repr__(self) -> str:
        return (
            f"TrajectoryTree(id={self.id[:12]}, nodes={len(self.nodes) - 1}, "
            f"trajectories={len(self.records)}, divergence_points={len(self.divergence_points())})"
        )
