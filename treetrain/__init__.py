"""treetrain: an RL trainer for LLM agents over prefix trees of trajectories.

Shared prefixes are evaluated once and kept resident; only the branch suffixes that carry loss are replayed
under autograd. docs/design.md has the vocabulary, docs/python-api.md the Python entry points.

The engine-level names (`tree_update`, `build_batch` and their reports, `LossConfig`, `ReplayConfig`,
`AdvantageConfig`) load torch and transformers, so they are imported on first use: `import treetrain` stays
fast for the command line.

Example:
    >>> import treetrain
    >>> tree = treetrain.build_tree([treetrain.Trajectory("t0", (treetrain.Call((
    ...     treetrain.Segment(treetrain.Role.PROMPT, (1, 2)), treetrain.Segment(treetrain.Role.POLICY, (3,)))),), 1.0)])
    >>> len(tree.nodes), treetrain.tree_stats(tree).total_tokens
    (2, 3)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treetrain.errors import ConfigError, TreetrainError
from treetrain.lazy import lazy_names
from treetrain.trajectory import Call, Role, Segment, Trajectory, TrajectoryError, TrajectoryMeta
from treetrain.tree import TrajectoryTree, TreeStats, build_tree, tree_stats

if TYPE_CHECKING:
    from treetrain.api import BatchBuild, TreeUpdateReport, build_batch, tree_update
    from treetrain.loss.advantages import AdvantageConfig
    from treetrain.loss.loss_config import LossConfig
    from treetrain.replay.batch import ReplayConfig, ReplayReport, UpdateBatch

__version__ = "0.1.0"

_LAZY = {
    "BatchBuild": "treetrain.api",
    "TreeUpdateReport": "treetrain.api",
    "build_batch": "treetrain.api",
    "tree_update": "treetrain.api",
    "ReplayConfig": "treetrain.replay.batch",
    "ReplayReport": "treetrain.replay.batch",
    "UpdateBatch": "treetrain.replay.batch",
    "AdvantageConfig": "treetrain.loss.advantages",
    "LossConfig": "treetrain.loss.loss_config",
}

__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "AdvantageConfig",
    "BatchBuild",
    "Call",
    "ConfigError",
    "LossConfig",
    "ReplayConfig",
    "ReplayReport",
    "Role",
    "Segment",
    "Trajectory",
    "TrajectoryError",
    "TrajectoryMeta",
    "TrajectoryTree",
    "TreeStats",
    "TreeUpdateReport",
    "TreetrainError",
    "UpdateBatch",
    "__version__",
    "build_batch",
    "build_tree",
    "tree_stats",
    "tree_update",
]
