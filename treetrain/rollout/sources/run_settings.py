"""What a tree source reads of a run: its settings, its ranks, and the pieces the trainer hands over.

The sources sit below the trainer (docs/development.md), so they never import its config class: they read
it through `RunSettings`, the fields they use and no more, which `treetrain.train.config.TrainConfig`
satisfies as it is (mypy checks that where the trainer hands it over). In the same way `Ranks` is what they
use of the training backend: its rank, the world size, one gather of text, and the region in which ranks
may run forwards of different lengths.

Rollout seeds are a function of (run seed, update index), and each task's sampler seed a function of its
task seed (`task_seeds`), so a resumed run samples the same tasks with the same seeds as the uninterrupted
one, whatever the number of ranks.

Example:
    >>> from treetrain.train.config import load_config
    >>> task_seeds(load_config(None, ["seed=1", "rollout.groups_per_update=3"]), update=2)
    [1000009, 1000010, 1000011]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from treetrain.loss.loss_config import LossConfig
from treetrain.rollout.rollout_section import RolloutSection
from treetrain.runfs import make_dirs

if TYPE_CHECKING:
    from envs.protocol import Environment
    from treetrain.rollout.engines.sampler_process import SamplerProcess


class ModelSettings(Protocol):
    """The `model` section, as the rollout reads it."""

    @property
    def path(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def lora(self) -> object | None: ...


class EnvSettings(Protocol):
    """The `env` section, as the rollout reads it."""

    @property
    def name(self) -> str: ...
    @property
    def kwargs(self) -> Mapping[str, Any]: ...
    @property
    def rubric(self) -> str | None: ...
    @property
    def max_tool_result_chars(self) -> int: ...
    @property
    def tool_format(self) -> str: ...
    @property
    def end_of_turn(self) -> str | None: ...
    @property
    def template_kwargs(self) -> Mapping[str, Any]: ...


class DistributedSettings(Protocol):
    """The `distributed` section, as the rollout reads it."""

    @property
    def backend(self) -> str: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def deepspeed_config(self) -> str | None: ...


class RunSettings(Protocol):
    """A run's settings, as the tree sources read them (`treetrain.train.config.TrainConfig` is one)."""

    @property
    def run_dir(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def updates(self) -> int: ...
    @property
    def threads(self) -> int | None: ...
    @property
    def memory_budget(self) -> str | None: ...
    @property
    def model(self) -> ModelSettings: ...
    @property
    def env(self) -> EnvSettings: ...
    @property
    def distributed(self) -> DistributedSettings: ...
    @property
    def rollout(self) -> RolloutSection: ...
    @property
    def loss(self) -> LossConfig: ...


class Ranks(Protocol):
    """What the sources use of the training backend (`treetrain.distributed.backend.TrainBackend` is one)."""

    @property
    def module(self) -> Any:
        """The policy being trained."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def gather(self, text: str) -> list[str]:
        """Every rank's `text`, indexed by rank (a collective)."""

    def uneven(self) -> AbstractContextManager[None]:
        """A region where ranks may run forwards of different lengths (rollouts)."""


@dataclass(frozen=True)
class SourceInputs:
    """What the trainer hands a sampling source besides its settings."""

    tokenizer: Any
    make_env: Callable[[], Environment]
    ranks: Ranks
    checkpoint: str
    """Where `model.path` resolved to: a checkpoint directory, or a preset's name."""
    start: int = 0
    """The first update to train (a resumed run's next one)."""
    on_episode: Callable[[], None] | None = None
    """Called as each trajectory of a synchronous rollout finishes (the trainer's progress bar)."""
    on_point: Callable[[str, int | None], None] | None = None
    """Called on an asynchronous run's sampler thread as an update's rollout starts (`"rollout-start"`)
    and once it is queued (`"rollout-queued"`): the interruption tests' seam."""
    sampler: SamplerProcess | None = None
    """The sampler process started early (`treetrain.rollout.sources.sampler_start`), which the engine of
    an asynchronous run adopts."""


def task_seeds(cfg: RunSettings, update: int) -> list[int]:
    """The task seeds of update `update`, one per group (torch-free: the command line opens the first task
    before any model loads)."""
    n = cfg.rollout.groups_per_update
    return [cfg.seed * 1_000_003 + update * n + g for g in range(n)]


def update_dir(cfg: RunSettings, update: int) -> Path:
    """`<run_dir>/rollouts/update-XXXXX/`, made (a planted link on the way is refused, not followed)."""
    out_dir = Path(cfg.run_dir) / "rollouts" / f"update-{update:05d}"
    make_dirs(cfg.run_dir, out_dir / "trees")
    return out_dir
