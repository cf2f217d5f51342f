"""Where each update's trees come from: tree rollouts of the current policy, or recorded tree files.

Rollout seeds are a function of (run seed, update index), and each task's sampler seed a function of its task
seed, so a resumed run samples the same tasks with the same seeds as the uninterrupted one, whatever the
number of ranks. With several ranks each samples every W-th task, and the trees are exchanged (as tree-file
bytes) so that every rank enters the update window with the same groups, in task order.
"""

from __future__ import annotations

import base64
import glob
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.protocol import Environment
from envs.remote import EnvFailure
from envs.wrapper import WrapperConfig
from treetrain.distributed.backend import TrainBackend
from treetrain.errors import ConfigError
from treetrain.loss.loss_config import LossConfig
from treetrain.rollout.engines.generation import GenerationEngine
from treetrain.rollout.prefix_sampler import SamplerConfig
from treetrain.rollout.tree_rollout import RolloutConfig, rollout_trees
from treetrain.runfs import make_dirs
from treetrain.train.config import TrainConfig
from treetrain.train.env_failures import EnvironmentFailedError, share_failures, too_many, write_failures
from treetrain.tree import TrajectoryTree
from treetrain.tree.checks import check_distinct, check_vocabulary
from treetrain.tree.format import load_trees, tree_from_bytes, tree_to_bytes
from treetrain.tree.unpack import short_repr

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Produced:
    """One update's advantage groups (each a tuple of trees normalized together), how long they took, and
    how many tasks were lost to environment failures (their groups are not among `groups`)."""

    groups: tuple[tuple[TrajectoryTree, ...], ...]
    seconds: float
    failed_episodes: int = 0

    @property
    def trees(self) -> tuple[TrajectoryTree, ...]:
        return tuple(t for g in self.groups for t in g)


def task_seeds(cfg: TrainConfig, update: int) -> list[int]:
    n = cfg.rollout.groups_per_update
    return [cfg.seed * 1_000_003 + update * n + g for g in range(n)]


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


class RolloutSource:
    """Samples this rank's share of `groups_per_update` trees from the policy, then shares them.

    Every task of the update grows at once on one engine (`rollout.engine`), which is made on first use and
    synced to the trainer's weights whenever the model version moved (after every optimizer step). Trees are
    written under `<run_dir>/rollouts/update-XXXXX/` before training reads them.
    """

    def __init__(
        self, cfg: TrainConfig, tokenizer: Any, make_env: Callable[[], Environment], backend: TrainBackend
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.wrapper = wrapper_config(cfg, backend.module)
        if cfg.rollout.engine == "vllm-server" and backend.world_size > 1:
            raise ConfigError(
                "rollout.engine: 'vllm-server' runs with one trainer process (weights are written once and "
                f"reloaded by every server); this run has {backend.world_size}; use 'vllm' (one engine per rank)"
            )
        self.engine: GenerationEngine | None = make_engine(
            cfg, backend.module, self.wrapper.episode.episode_tokens()
        )
        """Made before the first update, so that a server that is down or a model vLLM cannot load stops the
        run before anything is sampled."""

    def _engine(self, model: Any, version: int) -> GenerationEngine:
        if self.engine is None:
            self.engine = make_engine(self.cfg, model, self.wrapper.episode.episode_tokens())
        if self.engine.version != version:
            with self.backend.uneven():
                self.engine.sync_weights(model, version)
        return self.engine

    def __call__(self, model: Any, update: int, version: int) -> Produced:
        start = time.perf_counter()
        r = self.cfg.rollout
        rank, world = self.backend.rank, self.backend.world_size
        out_dir = Path(self.cfg.run_dir) / "rollouts" / f"update-{update:05d}"
        make_dirs(self.cfg.run_dir, out_dir / "trees")  # a planted link on the way is refused, not followed
        was_training = model.training
        model.eval()
        try:
            engine = self._engine(model, version)
            config = RolloutConfig(
                fanout=r.fanout,
                sampler=SamplerConfig(r.sampling, seed=self.cfg.seed),
                wrapper=self.wrapper,
                rubric=self.cfg.env.rubric,
                model_version=version,
                max_concurrent_steps=r.max_concurrent_steps,
            )
            with self.backend.uneven():  # ranks generate different lengths (ZeRO-3: fetches rendezvous)
                result = rollout_trees(
                    model, self.tokenizer, self.make_env, task_seeds(self.cfg, update)[rank::world], out_dir,
                    config, env_name=self.cfg.env.name, engine=engine,
                )  # fmt: skip
        finally:
            model.train(was_training)
        self.stats = result.stats
        trees = share_trees(self.backend, result.trees)
        lost = share_failures(
            self.backend, write_failures(self.cfg.run_dir, update, rank, list(result.failures))
        )
        line = too_many(lost, len(task_seeds(self.cfg, update)), r.max_failed_fraction)
        if line is not None:
            raise EnvironmentFailedError(f"update {update}: {line}")
        for failure in lost:
            log.warning(
                "update %d: task seed %d dropped: %s (traceback in %s)",
                update, failure.seed, failure.error.line(), failure.log,
            )  # fmt: skip
        return Produced(tuple((t,) for t in trees), time.perf_counter() - start, len(lost))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def make_engine(cfg: TrainConfig, model: Any, max_tokens: int) -> GenerationEngine:
    """The engine `rollout.engine` names, serving `model` (its weights are synced before first use)."""
    kind = cfg.rollout.engine
    if kind != "hf":
        from treetrain.rollout.engines.weight_buckets import fused_experts

        fused = fused_experts(model)
        if fused is not None:
            raise ConfigError(
                f"rollout.engine: {kind!r} loads checkpoint-named weights, and this model keeps {fused} fused in "
                "memory (transformers' expert layout), which treetrain does not convert back yet; use 'hf'"
            )
        if (
            cfg.model.lora is not None
            and cfg.distributed.backend == "deepspeed"
            and cfg.distributed.zero_stage == 3
        ):
            raise ConfigError(
                f"rollout.engine: {kind!r} with LoRA under ZeRO-3 is not supported (the adapters would have to be "
                "merged into partitioned weights); use ZeRO 0-2 with LoRA, or rollout.engine='hf'"
            )
    if kind == "hf":
        from treetrain.rollout.engines.hf_engine import HFEngine

        return HFEngine(model, version=-1)
    if kind == "vllm-server":
        from treetrain.rollout.engines.adapter_sync import lora_serving
        from treetrain.rollout.engines.vllm_server import VLLMServerEngine

        return VLLMServerEngine(
            cfg.rollout.vllm, weights_dir=Path(cfg.run_dir) / "engine-weights", version=-1,
            lora=lora_serving(model),
        )  # fmt: skip
    from treetrain.rollout.engines.adapter_sync import lora_serving
    from treetrain.rollout.engines.vllm_engine import VLLMEngine
    from treetrain.train.models import resolve_model_path

    path = resolve_model_path(cfg.model.path)
    if not Path(path).is_dir():
        raise ConfigError(
            f"rollout.engine: 'vllm' loads the model from a checkpoint directory, and model.path={cfg.model.path!r} "
            "is a built-in preset; save it with save_pretrained and give that directory"
        )
    device = next(model.parameters()).device
    return VLLMEngine(
        path, cfg.rollout.vllm, dtype=cfg.model.dtype, max_model_len=max_tokens, seed=cfg.seed, version=-1,
        device=device.type, lora=lora_serving(model),
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
    end-of-turn marker, the tool format and the prompt's length against the episode budget all fail here."""
    from envs.template import TemplateError
    from envs.wrapper import TokenEnv

    try:
        episode = TokenEnv(make_env(), tokenizer, wrapper_config(cfg, model), env_name=cfg.env.name)
        episode.reset(task_seeds(cfg, 0)[0])
    except TemplateError as exc:
        raise ConfigError(f"env.end_of_turn / model.tokenizer: {exc}") from None
    except EnvFailure as exc:
        raise ConfigError(f"env.name: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"rollout.episode.max_episode_tokens: {exc}") from None


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


def check_lengths(trees: Sequence[TrajectoryTree], context: int | None, where: str) -> None:
    """Refuse recorded trees with a call longer than the model's context (naming both numbers)."""
    if context is None:
        return
    for tree in trees:
        for record in tree.records:
            for call in record.calls:
                length = sum(call.segment_lengths)
                if length > context:
                    raise ConfigError(
                        f"{where}: trajectory {record.id!r} has a call of {length} tokens, longer than the "
                        f"model's context of {context} tokens (max_position_embeddings)"
                    )


def check_sampler_logprobs(trees: Sequence[TrajectoryTree], where: str, loss: LossConfig) -> None:
    """`loss.ratio_source='sampler'` takes the PPO ratio's old logprobs from the file, and a
    `loss.sampler_correction` its weights: refuse, before any model loads, a tree with a policy segment that
    was recorded without them (trees imported without logprobs). Nothing to check when neither is on."""
    if loss.ratio_source == "sampler":
        field, value, fix = "loss.ratio_source", "'sampler'", "ratio_source='scoring'"
    elif loss.corrects_sampler:
        field, value, fix = (
            "loss.sampler_correction",
            repr(loss.sampler_correction),
            "sampler_correction='none'",
        )
    else:
        return
    for tree in trees:
        for record in tree.records:
            if any(lp is None for call in record.calls for lp in call.logprobs):
                raise ConfigError(
                    f"{field}: {value} needs the sampler's logprobs of every policy token, but in "
                    f"{where} trajectory {short_repr(record.id, 40)} has a policy segment without them; "
                    f"record them at rollout or use {fix}"
                )


def glob_files(pattern: str) -> list[Path]:
    """Files matching a glob, sorted; `**` never descends a symbolic link, so a link loop cannot hang it.

    `glob.glob(recursive=True)` follows links to directories at every level (a loop is walked until path
    names get too long, exponentially often); `pathlib`'s `**` does not, so the pattern's literal leading
    directories become the root of a `Path.glob`.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); os.makedirs(f"{d}/a"); os.symlink("..", f"{d}/a/loop")
        >>> _ = open(f"{d}/a/x.msgpack", "wb").close()
        >>> [p.name for p in glob_files(f"{d}/**/*.msgpack")]
        ['x.msgpack']
    """
    parts = Path(pattern).parts
    first = next((k for k, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    root = Path(*parts[:first]) if first else Path()
    if first == len(parts):
        return [root] if os.path.lexists(root) else []
    return sorted(root.glob(str(Path(*parts[first:]))))


class RecordedSource:
    """Consumes recorded tree files in sorted order, `groups_per_update` trees per update, cycling at the end.

    Every token id must exist in the model's vocabulary: trees tokenized with another tokenizer are refused
    before training starts. With fewer trees than `groups_per_update`, each update takes all of them.
    """

    def __init__(self, cfg: TrainConfig, vocab_size: int, context: int | None = None) -> None:
        assert cfg.rollout.trees is not None
        pattern = cfg.rollout.trees
        path = Path(pattern)
        try:  # a name too long or a symlink loop
            files = sorted(path.glob("**/*.msgpack")) if path.is_dir() else glob_files(pattern)
        except OSError as exc:
            raise ConfigError(
                f"rollout.trees: cannot list {short_repr(pattern, 80)}: {exc.strerror or exc}"
            ) from None
        if not files:
            raise ConfigError(f"rollout.trees: no .msgpack files at {short_repr(pattern, 200)}")
        self.groups: list[tuple[TrajectoryTree, ...]] = []
        for f in files:
            try:
                trees = load_trees(f)
            except OSError as exc:  # a FIFO, a device, a directory named *.msgpack, a symlink loop
                raise ConfigError(f"rollout.trees: cannot read {f}: {exc.strerror or exc}") from None
            check_vocabulary([(f"rollout.trees: {f}", trees)], vocab_size)
            check_lengths(trees, context, f"rollout.trees: {f}")
            check_sampler_logprobs(trees, f"rollout.trees: {f}", cfg.loss)
            self.groups.append(trees)  # a file's trees are one group (trees/README.md)
        check_distinct([(f"rollout.trees: {f}", g) for f, g in zip(files, self.groups)])
        self.per_update = min(cfg.rollout.groups_per_update, len(self.groups))
        if self.per_update < cfg.rollout.groups_per_update:
            log.warning(
                "rollout.trees holds %d groups, fewer than rollout.groups_per_update=%d: each update takes all",
                len(self.groups),
                cfg.rollout.groups_per_update,
            )

    def __call__(self, model: Any, update: int, version: int) -> Produced:
        n = len(self.groups)
        start = update * self.per_update
        if start // n != (start + self.per_update - 1) // n:
            log.info("recorded groups exhausted; starting another pass over %d groups", n)
        return Produced(tuple(self.groups[(start + i) % n] for i in range(self.per_update)), 0.0)
