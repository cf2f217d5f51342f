"""The msgpack tree file: save and load `TrajectoryTree`s without losing anything.

Every file holds a *group*, the trees whose leaves are normalized together; a single tree is a group of
one. `save_tree` / `load_tree` handle the one-tree case (loading a file of several trees is an error
that says to use `load_trees`); `save_trees` / `load_trees` handle groups. The schema is in
`trees/README.md`; `treetrain.tree.reader` validates it.

Writes are atomic: a temporary file in the target directory, fsync, then `os.replace`, so a crash leaves
either the old file or the new one, never half of one. Reading trusts nothing: any problem with the bytes
raises `TreeFormatError` naming the field (I/O errors such as a missing file stay `OSError`).

Example:
    >>> from treetrain.trajectory import Call, Role, Segment, Trajectory
    >>> call = Call((Segment(Role.PROMPT, (1, 2)), Segment(Role.POLICY, (3,), (-0.5,))))
    >>> from treetrain.tree.build import build_tree
    >>> tree = build_tree([Trajectory("t0", (call,), reward=1.0)])
    >>> again = tree_from_bytes(tree_to_bytes(tree))
    >>> again.id == tree.id, again.trajectories() == tree.trajectories()
    (True, True)
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence

import msgpack
import numpy as np

from treetrain.io import atomic_write_bytes, open_regular
from treetrain.tree.reader import decode_trees
from treetrain.tree.schema import (
    DEFAULT_LIMITS,
    FORMAT_NAME,
    FORMAT_VERSION,
    SAMPLING_VERSION,
    Limits,
    TreeFormatError,
)
from treetrain.tree.trajectory_tree import CallRecord, TrajectoryRecord, TrajectoryTree

__all__ = [
    "DEFAULT_LIMITS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Limits",
    "TreeFormatError",
    "load_tree",
    "load_trees",
    "save_tree",
    "save_trees",
    "tree_from_bytes",
    "tree_to_bytes",
    "trees_from_bytes",
    "trees_to_bytes",
]

_UINT32_MAX = (1 << 32) - 1
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1


# ----- writing ----------------------------------------------------------------------------------------
def trees_to_bytes(trees: Sequence[TrajectoryTree]) -> bytes:
    """Encode a group. Raises TreeFormatError if a value cannot be represented (e.g. a token >= 2**32)."""
    trees = list(trees)
    if not trees:
        raise TreeFormatError("trees: a group needs at least one tree")
    recorded = any(
        t.sampling is not None or any(c.versions for r in t.records for c in r.calls) for t in trees
    )
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION if recorded else SAMPLING_VERSION - 1,
        "trees": [_encode_tree(t, f"trees[{k}]") for k, t in enumerate(trees)],
    }
    try:
        return msgpack.packb(doc, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as e:
        raise TreeFormatError(f"trees: cannot encode ({e})") from None


def tree_to_bytes(tree: TrajectoryTree) -> bytes:
    """Encode one tree as a group of one."""
    return trees_to_bytes([tree])


def _encode_tree(tree: TrajectoryTree, where: str) -> dict[str, object]:
    nodes = []
    for n in tree.nodes:
        if n.tokens and max(n.tokens) > _UINT32_MAX:
            raise TreeFormatError(
                f"{where}.nodes[{n.index}].tokens: token id {max(n.tokens)} does not fit in uint32"
            )
        nodes.append(
            {
                "parent": n.parent,
                "tokens": np.asarray(n.tokens, dtype="<u4").tobytes(),
                "roles": bytes(r.code for r in n.roles),
                "id": n.id,
            }
        )
    out: dict[str, object] = {
        "id": tree.id,
        "nodes": nodes,
        "trajectories": [_encode_record(r, f"{where}.trajectories[{i}]") for i, r in enumerate(tree.records)],
    }
    if tree.sampling is not None:
        out["sampling"] = {
            "temperature": float(tree.sampling.temperature),
            "top_p": float(tree.sampling.top_p),
        }
    return out


def _encode_record(rec: TrajectoryRecord, where: str) -> dict[str, object]:
    return {
        "id": rec.id,
        "reward": float(rec.reward),
        "step_rewards": [float(x) for x in rec.step_rewards],
        "meta": {
            "env": rec.meta.env,
            "seed": _int64(rec.meta.seed, f"{where}.meta.seed"),
            "model_version": _int64(rec.meta.model_version, f"{where}.meta.model_version"),
            "extra": dict(rec.meta.extra),
        },
        "calls": [_encode_call(c, f"{where}.calls[{ci}]") for ci, c in enumerate(rec.calls)],
    }


def _encode_call(call: CallRecord, where: str) -> dict[str, object]:
    out: dict[str, object] = {
        "end": call.end,
        "segment_lengths": list(call.segment_lengths),
        "logprobs": [None if lp is None else np.asarray(lp, dtype="<f8").tobytes() for lp in call.logprobs],
    }
    if call.versions:  # absent when unknown, so an unversioned call is written as before
        out["versions"] = [_int64(v, f"{where}.versions[{j}]") for j, v in enumerate(call.versions)]
    return out


def _int64(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TreeFormatError(f"{where}: {value!r} is not an int")
    out = int(value)
    if not _INT64_MIN <= out <= _UINT64_MAX:
        raise TreeFormatError(f"{where}: {out} does not fit in msgpack's int range [-2**63, 2**64)")
    return out


def file_bytes(trees: Sequence[TrajectoryTree], where: str) -> bytes:
    """The bytes of a tree file for `trees`, refused (TreeFormatError naming `where`) when `load_trees`
    would refuse them.

    The reader bounds a file by `DEFAULT_LIMITS` (its size, the summed call length, node visits per byte);
    the writer is held to the same ones by decoding its own bytes under them before anything reaches the
    disk, so a file treetrain writes is one its reader, `treetrain inspect` and training accept.
    """
    data = trees_to_bytes(trees)
    try:
        if len(data) > DEFAULT_LIMITS.max_file_bytes:
            raise TreeFormatError(f"{len(data)} bytes exceeds the limit of {DEFAULT_LIMITS.max_file_bytes}")
        decode_trees(data, DEFAULT_LIMITS)
    except TreeFormatError as e:
        raise TreeFormatError(f"{where}: not written, its reader would refuse it: {e}") from None
    return data


def save_trees(trees: Sequence[TrajectoryTree], path: str | os.PathLike[str]) -> None:
    """Atomically write a group of trees to `path`; nothing is written when its reader would refuse it."""
    atomic_write_bytes(path, file_bytes(trees, os.fspath(path)))


def save_tree(tree: TrajectoryTree, path: str | os.PathLike[str]) -> None:
    """Atomically write one tree (a group of one) to `path`."""
    save_trees([tree], path)


# ----- reading ----------------------------------------------------------------------------------------
def trees_from_bytes(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[TrajectoryTree, ...]:
    """Decode and validate a group. Raises TreeFormatError on any problem with the bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    return decode_trees(bytes(data), limits)


def tree_from_bytes(data: bytes, limits: Limits = DEFAULT_LIMITS) -> TrajectoryTree:
    """Decode and validate bytes holding exactly one tree."""
    return _only(trees_from_bytes(data, limits), "data")


def load_trees(path: str | os.PathLike[str], limits: Limits = DEFAULT_LIMITS) -> tuple[TrajectoryTree, ...]:
    """Read a group. The file size is checked against `limits` before anything is read."""
    name = os.fspath(path)
    with open_regular(name) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limits.max_file_bytes:
            raise TreeFormatError(f"{name}: {size} bytes exceeds the limit of {limits.max_file_bytes}")
        data = f.read(limits.max_file_bytes + 1)
    try:
        return decode_trees(data, limits)
    except TreeFormatError as e:
        raise TreeFormatError(f"{name}: {e}") from None


def load_tree(path: str | os.PathLike[str], limits: Limits = DEFAULT_LIMITS) -> TrajectoryTree:
    """Read a file holding exactly one tree."""
    return _only(load_trees(path, limits), os.fspath(path))


def _only(trees: tuple[TrajectoryTree, ...], name: str) -> TrajectoryTree:
    if len(trees) != 1:
        raise TreeFormatError(
            f"{name}: holds a group of {len(trees)} trees; use load_trees / trees_from_bytes"
        )
    return trees[0]
