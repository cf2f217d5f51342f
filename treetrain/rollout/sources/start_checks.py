"""What the rollout checks of a run's settings before torch loads: its environment and its inference servers.

`treetrain.train.preflight` calls `check_rollout_inputs` first thing, so that a mistake in either is one
line within a second, and the trainer reads no engine setting itself. Nothing here imports torch.
"""

from __future__ import annotations

from treetrain.rollout.env_check import check_environment_config
from treetrain.rollout.sources.run_settings import RunSettings, task_seeds


def check_rollout_inputs(cfg: RunSettings) -> None:
    """The environment (built and its first task opened in a worker, `check_environment_config`) and, for
    an engine that runs as servers, one short request to each; nothing for a run on recorded trees."""
    r = cfg.rollout
    if r.trees:
        return
    e = cfg.env
    check_environment_config(e.name, e.kwargs, e.rubric, task_seeds(cfg, 0)[0], r.episode.step_timeout_s)
    if r.engine == "vllm-server":
        from treetrain.rollout.engines.server_calls import check_reachable

        check_reachable(r.vllm.urls, wait_s=r.vllm.startup_wait_s)
