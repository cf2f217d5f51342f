"""Where each update's trees come from: tree rollouts of the current policy, or recorded tree files.

Rollout seeds are a function of (run seed, update index), and each task's sampler seed a function of its task
seed, so a resumed run samples the same tasks with the same seeds as the uninterrupted one, whatever the
number of ranks. With several ranks each samples every W-th task, and the trees are exchanged (as tree-file
bytes) so that every rank enters the update window with the same groups, in task order.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from envs.env_error import EnvFailure
from envs.protocol import Environment
from envs.wrapper import WrapperConfig
from treetrain.distributed.backend import TrainBackend
from treetrain.errors import ConfigError
from treetrain.models.module_modes import evaluating
from treetrain.rollout.engines.factory import EngineSpec, make_engine
from treetrain.rollout.engines.generation import GenerationEngine
from treetrain.rollout.prefix_sampler import SamplerConfig
from treetrain.rollout.tree_rollout import RolloutConfig, RolloutResult, rollout_trees
from treetrain.runfs import make_dirs
from treetrain.train.config import TrainConfig
from treetrain.train.env_failures import EnvironmentFailedError, share_failures, too_many, write_failures
from treetrain.train.held_out import task_seeds
from treetrain.train.staleness import Dropped, Staleness
from treetrain.tree import TrajectoryTree
from treetrain.tree.format import tree_from_bytes, tree_to_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Produced:
    """One update's advantage groups (each a tuple of trees normalized together), how long they took, and
    how many tasks were lost to environment failures (their groups are not among `groups`)."""

    groups: tuple[tuple[TrajectoryTree, ...], ...]
    seconds: float
    failed_episodes: int = 0
    step_timeouts: int = 0
    """Environment steps that missed their deadline (all ranks)."""
    interrupted: int = 0
    """Samples stopped mid-turn for newer weights and resubmitted (all ranks; asynchronous runs only)."""
    staleness: Staleness = field(default_factory=Staleness)
    """Version lags of the policy tokens of `groups` (empty for recorded trees: their versions are another
    run's)."""
    stale: Dropped = field(default_factory=Dropped)
    """Groups left out for a token over `rollout.max_staleness` (not among `groups`)."""
    queue_depth: int = 0
    """Later updates' rollouts finished and waiting when these trees were taken."""
    sampler_idle: float = 0.0
    """Seconds the sampler waited for the pacing rule before growing these trees."""
    trainer_idle: float = 0.0
    """Seconds the trainer waited for these trees (all of `seconds` in a synchronous rollout)."""
    servers_lost: int = 0
    """`vllm-server`: servers lost while these trees grew."""
    servers: tuple[tuple[str, int, int, float], ...] = ()
    """`vllm-server`: each server's share (`ServerStats.row`)."""

    @property
    def trees(self) -> tuple[TrajectoryTree, ...]:
        return tuple(t for g in self.groups for t in g)


def share_trees(backend: TrainBackend, local: tuple[TrajectoryTree, ...]) -> tuple[TrajectoryTree, ...]:
    """Every rank's trees, in task order (rank r sampled tasks r, r + W, ...)."""
    if backend.world_size == 1:
        return local
    payload = json.dumps([base64.b64encode(tree_to_bytes(t)).decode("ascii") for t in local])
    per_rank = [
        [tree_from_bytes(base64.b64decode(x)) for x in json.loads(p)] for p in backend.gather(payload)
    ]
    total = sum(len(p) for p in per_rank)
    w = backend.world_size
    return tuple(per_rank[i % w][i // w] for i in range(total))


def share_count(backend: TrainBackend, local: int) -> int:
    """The sum of a count over every rank."""
    if backend.world_size == 1:
        return local
    return sum(int(part) for part in backend.gather(str(int(local))))


class RolloutSource:
    """Samples this rank's share of `groups_per_update` trees from the policy, then shares them.

    Every task of the update grows at once on one engine (`rollout.engine`), which is made on first use and
    synced to the trainer's weights whenever the model version moved (after every optimizer step). Trees are
    written under `<run_dir>/rollouts/update-XXXXX/` before training reads them.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        tokenizer: Any,
        make_env: Callable[[], Environment],
        backend: TrainBackend,
        on_episode: Callable[[], None] | None = None,
    ) -> None:
        """`on_episode` is called as each trajectory of a rollout finishes (the trainer's progress bar)."""
        self.on_episode = on_episode
        self.cfg = cfg
        self.backend = backend
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.wrapper = wrapper_config(cfg, backend.module)
        self.spec = engine_spec(cfg, backend.module, backend.world_size)
        self.engine: GenerationEngine | None = make_engine(self.spec, backend.module)
        """Made before the first update, so that a server that is down or a model vLLM cannot load stops the
        run before anything is sampled."""

    def _engine(self, model: Any, version: int) -> GenerationEngine:
        if self.engine is None:
            self.engine = make_engine(self.spec, model)
        if self.engine.version != version:
            with self.backend.uneven():
                self.engine.sync_weights(model, version)
        return self.engine

    @contextlib.contextmanager
    def serving(self, model: Any, version: int) -> Iterator[GenerationEngine]:
        """The rollout engine serving `model`'s weights of `version` (held-out evaluation samples on it)."""
        yield self._engine(model, version)

    def trained(self, update: int, model: Any, version: int) -> None:
        """Update `update` stepped to `version`: the next rollout syncs the engine itself."""

    def __call__(self, model: Any, update: int, version: int) -> Produced:
        start = time.perf_counter()
        rank, world = self.backend.rank, self.backend.world_size
        out_dir = update_dir(self.cfg, update)
        with evaluating(model):  # each module back in its own mode afterwards, not the wrapper's flag
            engine = self._engine(model, version)
            config = replace(rollout_config(self.cfg, self.wrapper, version), on_episode=self.on_episode)
            with self.backend.uneven():  # ranks generate different lengths (ZeRO-3: fetches rendezvous)
                result = rollout_trees(
                    model, self.tokenizer, self.make_env, task_seeds(self.cfg, update)[rank::world], out_dir,
                    config, env_name=self.cfg.env.name, engine=engine,
                )  # fmt: skip
        self.stats = result.stats
        produced = gather_update(self.cfg, self.backend, update, result, time.perf_counter() - start)
        return replace(produced, staleness=lags_of(produced.trees, version), trainer_idle=produced.seconds)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def lags_of(trees: Sequence[TrajectoryTree], version: int) -> Staleness:
    """The version lags of every policy token of `trees`, trained at `version`."""
    out = Staleness()
    for tree in trees:
        out = out.merged(Staleness.of(tree, version))
    return out


def update_dir(cfg: TrainConfig, update: int) -> Path:
    """`<run_dir>/rollouts/update-XXXXX/`, made (a planted link on the way is refused, not followed)."""
    out_dir = Path(cfg.run_dir) / "rollouts" / f"update-{update:05d}"
    make_dirs(cfg.run_dir, out_dir / "trees")
    return out_dir


def rollout_config(cfg: TrainConfig, wrapper: WrapperConfig, version: int | None) -> RolloutConfig:
    """How the run grows one update's trees; `version` is the weight version every sample must come from
    (None: not checked, the sampler of an asynchronous run records each turn's own)."""
    r = cfg.rollout
    return RolloutConfig(
        fanout=r.fanout, sampler=SamplerConfig(r.sampling, seed=cfg.seed), wrapper=wrapper,
        rubric=cfg.env.rubric, model_version=version, max_concurrent_steps=r.max_concurrent_steps,
    )  # fmt: skip


def gather_update(
    cfg: TrainConfig, backend: TrainBackend, update: int, result: RolloutResult, seconds: float
) -> Produced:
    """Every rank's trees of `update` (a collective), its failures logged and written, and the run stopped
    when too many tasks failed (`rollout.max_failed_fraction`)."""
    r = cfg.rollout
    trees = share_trees(backend, result.trees)
    lost = share_failures(backend, write_failures(cfg.run_dir, update, backend.rank, list(result.failures)))
    line = too_many(lost, len(task_seeds(cfg, update)), r.max_failed_fraction)
    if line is not None:
        raise EnvironmentFailedError(f"update {update}: {line}")
    for failure in lost:
        log.warning(
            "update %d: task seed %d dropped: %s (traceback in %s)",
            update, failure.seed, failure.error.line(), failure.log,
        )  # fmt: skip
    timeouts = share_count(backend, result.step_timeouts)
    if timeouts:
        log.warning(
            "update %d: %d environment steps missed rollout.episode.step_timeout_s=%ss (each became a "
            "timeout observation; step_timeouts in metrics.jsonl)",
            update, timeouts, r.episode.step_timeout_s,
        )  # fmt: skip
    interrupted = share_count(backend, result.interrupted) if r.max_staleness >= 1 else 0
    return Produced(
        tuple((t,) for t in trees), seconds, len(lost), timeouts, interrupted=interrupted,
        servers_lost=result.stats.servers_lost, servers=tuple(s.row() for s in result.stats.servers),
    )  # fmt: skip


def engine_spec(cfg: TrainConfig, model: Any, world_size: int) -> EngineSpec:
    """What the engine factory needs to know about this run (`treetrain.rollout.engines.factory`)."""
    from treetrain.bytesize import parse_bytes
    from treetrain.train.models import resolve_model_path

    r = cfg.rollout
    if r.hf_kv_budget is not None:
        kv_bytes = parse_bytes(r.hf_kv_budget)
    else:  # the rollout runs between updates: a quarter of what the planner may plan for
        from treetrain.update.planning import device_memory

        budget = (
            parse_bytes(cfg.memory_budget)
            if cfg.memory_budget
            else device_memory(next(model.parameters()).device)
        )
        kv_bytes = budget // 4
    lora_z3 = (
        cfg.model.lora is not None
        and cfg.distributed.backend == "deepspeed"
        and cfg.distributed.zero_stage == 3
    )
    return EngineSpec(
        r.engine, r.vllm, run_dir=cfg.run_dir, model_path=str(cfg.model.path),
        checkpoint=str(resolve_model_path(cfg.model.path)), max_tokens=wrapper_config(cfg, model).episode.episode_tokens(),
        dtype=cfg.model.dtype, seed=cfg.seed, world_size=world_size, lora_under_zero3=lora_z3, hf_kv_bytes=kv_bytes,
        in_flight_weights=r.max_staleness >= 1, threads=cfg.threads,
    )  # fmt: skip


def wrapper_config(cfg: TrainConfig, model: Any) -> WrapperConfig:
    """The episode budgets, template settings and stop ids of the rollouts (the model fills the gaps)."""
    r, e = cfg.rollout, cfg.env
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops = tuple(int(t) for t in ([eos] if isinstance(eos, int) else eos or ()))
    return WrapperConfig(
        episode=r.episode.for_context(model_context(model)), max_tool_result_chars=e.max_tool_result_chars,
        end_of_turn=e.end_of_turn, tool_format=e.tool_format, stop_token_ids=stops,
        template_kwargs=dict(e.template_kwargs),
    )  # fmt: skip


def check_template(
    cfg: TrainConfig, tokenizer: Any, make_env: Callable[[], Environment] | None = None
) -> None:
    """The chat template, `env.end_of_turn` and `env.tool_format` against the tokenizer, and the template's
    tool support against the first task's tools, before any model loads."""
    from envs.template import ChatTemplate, TemplateError

    try:
        template = ChatTemplate(
            tokenizer, cfg.env.end_of_turn, cfg.env.tool_format, template_kwargs=dict(cfg.env.template_kwargs)
        )
    except TemplateError as exc:
        raise ConfigError(f"env.end_of_turn / env.tool_format / model.tokenizer: {exc}") from None
    if make_env is None:
        return
    try:
        env = make_env()
        env.reset(task_seeds(cfg, 0)[0])
        template.check_tools(tuple(env.tool_specs()))
    except TemplateError as exc:
        raise ConfigError(f"model.tokenizer: {exc}") from None
    except EnvFailure as exc:
        raise ConfigError(f"env.name: {exc}") from None


def check_first_prompt(
    cfg: TrainConfig, tokenizer: Any, model: Any, make_env: Callable[[], Environment]
) -> None:
    """Open the first task through the token wrapper before anything is written: the chat template, the
    end-of-turn marker and the tool format fail here. The prompt's length is judged for the setup, not for
    this one task: one long task prompt fails its own task in the rollout (counted in `failed_episodes`,
    wherever it is in the task file), so it only stops the run here when what every prompt holds, the chat
    template and the tools around empty messages, leaves no room under the episode budget."""
    from envs.template import TemplateError
    from envs.wrapper import PromptTooLongError, TokenEnv

    seed = task_seeds(cfg, 0)[0]
    try:
        env = make_env()
        episode = TokenEnv(env, tokenizer, wrapper_config(cfg, model), env_name=cfg.env.name)
        try:
            episode.reset(seed)
        except PromptTooLongError as exc:
            fixed = setup_prompt_tokens(episode, env.reset(seed), tuple(env.tool_specs()))
            if fixed >= episode.episode_tokens:
                raise ConfigError(
                    f"rollout.episode.max_episode_tokens: the chat template and the tools alone take {fixed} "
                    f"tokens of every prompt, which leaves no room under max_episode_tokens="
                    f"{episode.episode_tokens}; raise it (or leave it null for the model's context)"
                ) from None
            log.warning("%s; tasks whose prompt does not fit fail and are counted in failed_episodes", exc)
    except TemplateError as exc:
        raise ConfigError(f"env.end_of_turn / model.tokenizer: {exc}") from None
    except EnvFailure as exc:
        raise ConfigError(f"env.name: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"rollout.episode.max_episode_tokens: {exc}") from None


def setup_prompt_tokens(episode: Any, opening: Sequence[Any], tools: Sequence[Any]) -> int:
    """Tokens of a prompt whose messages are empty: the chat template and the tool schemas, which every
    task's prompt holds whatever its text (`episode` a `TokenEnv`, `opening` a task's first messages)."""
    empty = tuple(replace(message, content="") for message in opening)
    return len(episode.template.encode(episode.template.render(empty, tuple(tools), generation_prompt=True)))


def model_context(model: Any) -> int | None:
    """The longest sequence the model takes (`max_position_embeddings`), or None when it does not say."""
    return config_context(model.config.get_text_config(decoder=True))


def config_context(config: Any) -> int | None:
    """`model_context` read from a text config, before the model is built."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_context(cfg: TrainConfig, model: Any) -> None:
    """Refuse episodes longer than the model's context before anything runs, naming both numbers."""
    context, wanted = model_context(model), cfg.rollout.episode.max_episode_tokens
    if context is not None and wanted is not None and wanted > context and cfg.rollout.trees is None:
        raise ConfigError(
            f"rollout.episode.max_episode_tokens: {wanted} tokens is longer than the model's context of {context} "
            "tokens (max_position_embeddings); lower it or leave it null to use the model's context"
        )
