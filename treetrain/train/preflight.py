"""Every check a run makes before its first rollout: one line for each mistake, as early as it can be seen.

Two stages. **Before torch** (`preflight`): loading torch and the model takes seconds to a minute, so every
mistake that can be seen without them is answered first, in the order a user would fix them: what the
rollout needs (the environment: its name, its `env.kwargs`, a task file that is missing or has a bad row,
its rubric; and any inference server it samples on: `treetrain.rollout.sources.start_checks`), the held-out
tasks, then the run directory (claimed and locked; `treetrain.train.rundir`) and, for `--resume`, the
settings a resume may change. `treetrain train` calls `preflight` before it imports the trainer, and hands
the result to `Trainer`; a `Trainer` built without one runs the same checks itself. Nothing here imports
torch at module level (`tests/cli/test_cli_paths.py` checks `sys.modules` after each of these errors).

**Once the tokenizer and the model load**: the chat template, `env.end_of_turn` and `env.tool_format`
against the tokenizer and the first task's tools (`check_template`, before the model loads), the episode
budget against the model's context (`check_context`), and the first task's prompt through the token
wrapper (`check_first_prompt`). `Trainer`, `treetrain plan --model` (`treetrain.train.model_check`) and
`treetrain eval` run these same functions.

Example:
    >>> from treetrain.train.config import load_config
    >>> preflight(load_config(None, ["env.name=nosuch"]), resume=False, overwrite=False)
    Traceback (most recent call last):
    ...
    envs.registry.UnknownEnvironmentError: unknown environment 'nosuch'. Available: ...
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from envs.env_error import EnvFailure
from envs.protocol import Environment
from treetrain.errors import ConfigError
from treetrain.rollout.sources.run_settings import task_seeds
from treetrain.rollout.sources.start_checks import check_rollout_inputs
from treetrain.train.config import TrainConfig
from treetrain.train.held_out import HeldOut, check_disjoint, held_out_tasks
from treetrain.train.resume import SAVED_CONFIG, check_resumable, saved_config
from treetrain.train.rundir import RunLock, claim_run_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preflight:
    """What the checks found and hold: the held-out tasks (None: no evaluation) and the run directory's lock
    (None on a rank other than 0, which never claims it)."""

    held: HeldOut | None
    lock: RunLock | None


def check_inputs(cfg: TrainConfig) -> HeldOut | None:
    """Every check that writes nothing: the rollout's environment and servers, and the held-out tasks."""
    check_rollout_inputs(cfg)
    check_disjoint(cfg)
    return held_out_tasks(cfg.env.name, cfg.env.kwargs, cfg.eval.tasks) if cfg.eval.every else None


def preflight(cfg: TrainConfig, *, resume: bool, overwrite: bool) -> Preflight:
    """`check_inputs`, then claim the run directory (rank 0) and, for a resume, refuse settings it may not
    change (every rank). The lock is released again when the resume check refuses."""
    held = check_inputs(cfg)
    run_dir = Path(cfg.run_dir)
    rank = int(os.environ.get("RANK", "0"))  # known from the launcher before any backend exists
    lock = claim_run_dir(run_dir, resume=resume, overwrite=overwrite) if rank == 0 else None
    try:
        if resume:  # the same run: only the settings a resume may change differ
            check_resumable(saved_config(run_dir), cfg, run_dir / SAVED_CONFIG)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Preflight(held, lock)


# ----- once the tokenizer and the model load ------------------------------------------------------------
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


def check_context(cfg: TrainConfig, model: Any) -> None:
    """Refuse episodes longer than the model's context before anything runs, naming both numbers."""
    from treetrain.rollout.sources.engine_config import model_context

    context, wanted = model_context(model), cfg.rollout.episode.max_episode_tokens
    if context is not None and wanted is not None and wanted > context and cfg.rollout.trees is None:
        raise ConfigError(
            f"rollout.episode.max_episode_tokens: {wanted} tokens is longer than the model's context of {context} "
            "tokens (max_position_embeddings); lower it or leave it null to use the model's context"
        )


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
    from treetrain.rollout.sources.engine_config import wrapper_config

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
