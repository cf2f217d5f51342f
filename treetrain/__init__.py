"""treetrain: an RL trainer for LLM agents over prefix trees of trajectories.

Shared prefixes are evaluated once and kept resident; only the branch suffixes that carry loss are replayed
under autograd. See README.md and DESIGN.md for the vocabulary.
"""

from treetrain.trajectory import Call, Role, Segment, Trajectory, TrajectoryError, TrajectoryMeta
from treetrain.tree import TrajectoryTree

__version__ = "0.1.0"

__all__ = [
    "Call",
    "Role",
    "Segment",
    "Trajectory",
    "TrajectoryError",
    "TrajectoryMeta",
    "TrajectoryTree",
    "__version__",
]
