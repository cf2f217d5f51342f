"""Loss targets: which predicted tokens carry loss, and each trajectory's share of them.

Two views of the same data. `tree_targets` gives, for every node, its own policy tokens: token k of a node
is predicted by the position just before it, which for k = 0 is the parent's last token. Replay therefore
feeds each unit with its parent's last token in front (the *overlap*), so a unit's forward predicts all of
its own tokens and gradient never has to enter through a parent's logits. Each target has one
contribution per trajectory through the node. `call_targets` gives the conventional per-call view
(position t-1 predicts owned policy token t) that the flat reference uses. Coefficients, advantages and sampler logprobs come from the same tables, so the two
views can only disagree if the tree decomposition is wrong.

A trajectory's term at a token is counted once even when several of its calls pass through that token: the
earliest such call owns it (`Trajectory.owned_policy_mask`), and its sampler logprobs are the ones used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from treetrain.loss.advantages import TreeAdvantages
from treetrain.loss.loss_config import LossConfig
from treetrain.loss.manifest import Manifest
from treetrain.trajectory import Role, Trajectory
from treetrain.tree.trajectory_tree import ROOT, CallRef, TrajectoryTree


@dataclass(frozen=True)
class TargetTable:
    """Targets of one forward piece, ordered by position; contributions in CSR form.

    `positions` `[M]` are input positions of the piece that predict each target; in the per-node tables of
    `tree_targets` they are instead the targets' token indices within the node (see `for_unit`).
    `contrib_target` `[C]` indexes the targets.
    """

    positions: np.ndarray  # [M] int64
    tokens: np.ndarray  # [M] int64
    contrib_target: np.ndarray  # [C] int64
    coef: np.ndarray  # [C] float64
    advantage: np.ndarray  # [C] float64
    sampler_logprob: np.ndarray  # [C] float64, NaN where the sampler gave none
    trajectory: np.ndarray  # [C] int64, trajectory index in the tree
    sampler_version: np.ndarray | None = None  # [C] int64, the weight version that sampled it, -1 unknown

    @property
    def num_targets(self) -> int:
        return int(self.positions.shape[0])

    def is_inert(self) -> bool:
        """True when every contribution has zero advantage (so, without KL/entropy, zero gradient)."""
        return bool(np.all(self.advantage == 0.0))

    def for_unit(self, start: int, end: int, overlap: bool) -> TargetTable:
        """A node table's targets with token index in [start, end), as input positions of that unit.

        With an overlap token in front, token k sits at input position k - start + 1 and is predicted by
        position k - start; without one, it is predicted by position k - start - 1.
        """
        lo, hi = np.searchsorted(self.positions, [start, end])
        keep = (self.contrib_target >= lo) & (self.contrib_target < hi)
        return TargetTable(
            self.positions[lo:hi] - start - (0 if overlap else 1),
            self.tokens[lo:hi],
            self.contrib_target[keep] - lo,
            self.coef[keep],
            self.advantage[keep],
            self.sampler_logprob[keep],
            self.trajectory[keep],
            None if self.sampler_version is None else self.sampler_version[keep],
        )


EMPTY = TargetTable(
    *(np.zeros(0, dtype=dt) for dt in (np.int64, np.int64, np.int64, float, float, float, np.int64))
)


def _owner_calls(tree: TrajectoryTree) -> dict[tuple[int, int], int]:
    """(trajectory, node) -> index of the earliest call of that trajectory whose path contains the node.

    Each call walks up from its end only until a node an earlier call of its trajectory already claimed
    (those claims are closed under ancestors), so the work is the (node, trajectory) pairs plus the calls,
    never calls x depth."""
    owner: dict[tuple[int, int], int] = {}
    for t, rec in enumerate(tree.records):
        for c, call in enumerate(rec.calls):
            n: int | None = call.end
            while n is not None and n != ROOT and (t, n) not in owner:
                owner[(t, n)] = c
                n = tree.nodes[n].parent
    return owner


def _policy_counts(tree: TrajectoryTree) -> tuple[list[int], list[int]]:
    """Per node: its policy tokens that can be targets (a sequence's first token cannot), and the policy
    tokens on the path above it (nodes come parent first, as `build_tree` and the reader guarantee)."""
    own = [0] * len(tree.nodes)
    above = [0] * len(tree.nodes)
    for n in tree.nodes[1:]:
        first = 1 if n.parent == ROOT else 0
        own[n.index] = sum(1 for r in n.roles[first:] if r is Role.POLICY)
        assert n.parent is not None
        parent = tree.nodes[n.parent]
        above[n.index] = above[n.parent] + sum(1 for r in parent.roles if r is Role.POLICY)
    return own, above


def _coefficients(tree: TrajectoryTree, manifest: Manifest, cfg: LossConfig) -> np.ndarray:
    return np.array([manifest.coefficient(tree.id, r.id, cfg) for r in tree.records], dtype=np.float64)


def _policy_logprobs(tree: TrajectoryTree, ref: CallRef) -> tuple[tuple[float, int], ...] | None:
    """A call's sampler logprobs with the weight version that sampled each (-1 unknown), one per policy
    token in order, or None when any segment lacks logprobs."""
    crec = tree.records[ref.trajectory].calls[ref.call]
    if any(lp is None for lp in crec.logprobs):
        return None
    return tuple(
        (x, -1 if crec.version(j) is None else int(crec.version(j)))  # type: ignore[arg-type]
        for j, lp in enumerate(crec.logprobs)
        if lp is not None
        for x in lp
    )


@dataclass
class _TableBuilder:
    """Accumulates targets and their contributions, then freezes them into a `TargetTable`."""

    positions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    contrib_target: list[int] = field(default_factory=list)
    coef: list[float] = field(default_factory=list)
    advantage: list[float] = field(default_factory=list)
    sampler_logprob: list[float] = field(default_factory=list)
    trajectory: list[int] = field(default_factory=list)
    sampler_version: list[int] = field(default_factory=list)

    def target(self, position: int, token: int) -> int:
        self.positions.append(position)
        self.tokens.append(token)
        return len(self.positions) - 1

    def contribution(
        self, target: int, coef: float, advantage: float, logprob: float, trajectory: int, version: int
    ) -> None:
        self.sampler_version.append(version)
        self.contrib_target.append(target)
        self.coef.append(coef)
        self.advantage.append(advantage)
        self.sampler_logprob.append(logprob)
        self.trajectory.append(trajectory)

    def build(self) -> TargetTable:
        i64 = np.int64
        return TargetTable(
            np.asarray(self.positions, dtype=i64),
            np.asarray(self.tokens, dtype=i64),
            np.asarray(self.contrib_target, dtype=i64),
            np.asarray(self.coef, dtype=np.float64),
            np.asarray(self.advantage, dtype=np.float64),
            np.asarray(self.sampler_logprob, dtype=np.float64),
            np.asarray(self.trajectory, dtype=i64),
            np.asarray(self.sampler_version, dtype=i64),
        )


def tree_targets(
    tree: TrajectoryTree, advantages: TreeAdvantages, manifest: Manifest, cfg: LossConfig
) -> tuple[TargetTable, ...]:
    """One `TargetTable` per node (the empty root's is empty); `positions` are token indices in the node."""
    coefs = _coefficients(tree, manifest, cfg)
    owner = _owner_calls(tree)
    _, above = _policy_counts(tree)
    sampler: dict[CallRef, tuple[tuple[float, int], ...] | None] = {}
    tables: list[TargetTable] = []
    for node in tree.nodes:
        if node.index == ROOT:
            tables.append(EMPTY)
            continue
        table = _TableBuilder()
        contribs = [j for j in sorted(node.trajectories) if coefs[j] > 0]
        first = 1 if node.parent == ROOT else 0  # a sequence's first token has nothing before it
        rank = above[node.index]  # the policy rank of the next policy token along any call's path
        for k in range(len(node)):
            if node.roles[k] is not Role.POLICY:
                continue
            rank += 1
            if k < first or not contribs:
                continue
            m = table.target(k, node.tokens[k])
            for j in contribs:
                ref = CallRef(j, owner[(j, node.index)])
                if ref not in sampler:
                    sampler[ref] = _policy_logprobs(tree, ref)
                lps = sampler[ref]
                lp, v = lps[rank - 1] if lps is not None else (math.nan, -1)
                table.contribution(m, coefs[j], advantages.at(j, node.index), lp, j, v)
        tables.append(table.build())
    return tuple(tables)


def call_target_counts(tree: TrajectoryTree, manifest: Manifest, cfg: LossConfig) -> dict[CallRef, int]:
    """The number of targets `call_targets` gives each call, read off the nodes each call owns.

    The planner prices flat mode with these: the work is the (node, trajectory) pairs, the calls and the
    nodes, never the calls' lengths (which shared prefixes make far larger than the file)."""
    positive = [bool(c > 0) for c in _coefficients(tree, manifest, cfg)]
    own, _ = _policy_counts(tree)
    counts = [[0] * len(r.calls) for r in tree.records]
    for (t, n), c in _owner_calls(tree).items():
        if positive[t]:
            counts[t][c] += own[n]
    return {CallRef(t, c): k for t, row in enumerate(counts) for c, k in enumerate(row)}


def call_targets(
    tree: TrajectoryTree,
    ref: CallRef,
    advantages: TreeAdvantages,
    manifest: Manifest,
    cfg: LossConfig,
    trajectory: Trajectory | None = None,
) -> TargetTable:
    """The conventional view of one call: position t-1 predicts each owned policy token t.

    `trajectory` is `tree.trajectory(ref.trajectory)` when the caller already rebuilt it (rebuilding it
    for every call of a many-call trajectory would cost calls x its tokens)."""
    coef = manifest.coefficient(tree.id, tree.records[ref.trajectory].id, cfg)
    traj = trajectory if trajectory is not None else tree.trajectory(ref.trajectory)
    owned = traj.owned_policy_mask(ref.call)
    toks = traj.calls[ref.call].tokens
    lps = tree.sampler_logprobs(ref)
    versions = [
        -1 if seg.version is None else seg.version
        for seg in traj.calls[ref.call].segments
        for _ in seg.tokens
    ]
    node_at = [n for n in tree.path(tree.call_end(ref)) for _ in tree.nodes[n].tokens]
    table = _TableBuilder()
    if coef > 0:
        for t in range(1, len(toks)):
            if owned[t]:
                m = table.target(t - 1, toks[t])
                lp = lps[t] if lps is not None else math.nan
                table.contribution(
                    m, coef, advantages.at(ref.trajectory, node_at[t]), lp, ref.trajectory, versions[t]
                )
    return table.build()
