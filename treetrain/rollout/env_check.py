"""The environment's settings checked before any model loads: one line for each way it cannot start.

The environment is built and its first task opened in a worker process (`envs.remote`), as rollouts will,
so a constructor that raises (or calls `os._exit`), a `reset` that raises or returns no messages, a tool
schema that is not JSON Schema, an unknown rubric and an environment that cannot be forked (tree rollouts
fork it at every branch point) all end the run here, each naming its `env.*` field, the method and the
exception.

Example:
    >>> check_environment_config("calculator", {"max_operands": 2})
    >>> check_environment_config("calculator", {}, rubric="exakt")
    Traceback (most recent call last):
    ...
    treetrain.errors.ConfigError: env.rubric: CalculatorEnv has no rubric 'exakt'; known: ['efficient', 'exact']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envs.registry import resolve
from envs.remote import EnvFailure, WorkerEnvFactory
from treetrain.errors import ConfigError


def check_environment_config(
    name: str,
    kwargs: Mapping[str, Any],
    rubric: str | None = None,
    seed: int = 0,
    timeout: float | None = 30.0,
) -> None:
    """Build environment `name` with `kwargs` in a worker, open task `seed`, pick `rubric` (None: the
    first) and fork once; raise `ConfigError` with one line on the first problem. `timeout` bounds each
    call as it bounds a rollout step (`rollout.episode.step_timeout_s`)."""
    resolve(name)  # an unknown name raises here, listing what is available
    factory = WorkerEnvFactory(name, kwargs, timeout)
    try:
        try:
            env = factory()
        except EnvFailure as exc:
            field = (
                "env.kwargs" if exc.error.exception.startswith(("TypeError", "ValueError")) else "env.name"
            )
            raise ConfigError(f"{field}: environment {name!r} rejected {dict(kwargs)}: {exc}") from None
        try:
            env.reset(seed)
        except EnvFailure as exc:
            raise ConfigError(f"env.name: environment {name!r}: {_protocol(exc)}") from None
        known = sorted(env.rubrics())
        if not known:
            raise ConfigError(f"env.rubric: {env.class_name} defines no rubrics; an environment needs one")
        if rubric is not None and rubric not in known:
            raise ConfigError(f"env.rubric: {env.class_name} has no rubric {rubric!r}; known: {known}")
        try:
            env.fork(0)
        except EnvFailure as exc:
            raise ConfigError(
                f"env.name: environment {name!r} cannot be forked, which tree rollouts do at every branch point "
                f"({exc}); make its state deep-copyable or override Environment.fork"
            ) from None
    finally:
        factory.close()


def _protocol(exc: EnvFailure) -> str:
    """A protocol error (a bad tool schema, say) reads as itself; anything else names the method too."""
    error = exc.error
    prefix = "ProtocolError: "
    if error.exception.startswith(prefix):
        return error.exception[len(prefix) :]
    return str(exc)
