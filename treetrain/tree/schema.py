"""Names, version and size limits of the tree file format, shared by the writer and the reader.

A tree file is one msgpack map `{"format": "treetrain.tree", "version": 2, "trees": [...]}` holding a
*group*: the trees whose leaves are normalized together (usually one). `trees/README.md` documents every
field. Version 2 adds a tree's `sampling` (temperature and top_p) and a call's `versions` (the weight version
of each policy segment); a group without either is written as version 1, so a file that needs nothing new stays readable by a version-1 reader. The limits bound what a reader allocates *before* it has seen the data: a declared length larger
than the limit, or larger than the bytes actually present, is refused without allocating.
"""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.errors import TreetrainError

FORMAT_NAME = "treetrain.tree"
"""Value of the top-level `format` field; anything else is not a tree file."""

FORMAT_VERSION = 2
"""The newest version this code writes (a group with no `sampling` and no `versions` is written as version 1)."""

SAMPLING_VERSION = 2
"""The first version with a tree's optional `sampling` map and a call's optional `versions` array."""

SUPPORTED_VERSIONS = frozenset({1, 2})
"""Versions this code reads. A new field or a changed meaning bumps the version (trees/README.md)."""


class TreeFormatError(TreetrainError, ValueError):
    """A tree file (or bytes) that does not follow the schema.

    The message names the field and the node / trajectory index, e.g.
    `trees[0].nodes[3].parent: 7 is not a valid parent index (must be < 3)`.
    """


@dataclass(frozen=True)
class Limits:
    """Upper bounds a reader enforces before allocating anything for a field."""

    max_file_bytes: int = 1 << 31
    """Largest file accepted (2 GiB); checked on the file size before reading it."""
    max_bin_bytes: int = 1 << 30
    """Largest single bin field (a node's tokens: 1 GiB is 256 Mi tokens)."""
    max_str_bytes: int = 1 << 20
    """Largest single string (ids, metadata values)."""
    max_array_len: int = 1 << 24
    """Most elements in one array (nodes, trajectories, calls, segments)."""
    max_map_len: int = 1 << 16
    """Most entries in one map (the only open-ended map is `meta.extra`)."""
    max_total_tokens: int = 1 << 28
    """Most tokens summed over every call of the file (T). Shared prefixes make T far larger than the
    file; loading never rebuilds the calls, but whoever replays them flat (the oracle, a flat plan) does."""
    node_visits_per_byte: int = 1
    """Most (node, trajectory) incidences, the entries of all `Node.trajectories` sets, per byte of file.
    Loading takes time and memory in proportion to the file plus these; a real tree has far fewer than
    one per byte, while a small file of one-token nodes shared by many trajectories could demand a
    quadratic number."""
    min_node_visits: int = 1 << 16
    """The incidences any file may have, however small, so tiny files never hit the per-byte limit."""

    def __post_init__(self) -> None:
        for name in (
            "max_file_bytes",
            "max_bin_bytes",
            "max_str_bytes",
            "max_array_len",
            "max_map_len",
            "max_total_tokens",
            "node_visits_per_byte",
            "min_node_visits",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()
