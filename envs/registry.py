"""Finding an environment class by name. Nothing registers itself on import.

A name resolves, in this order, through:

1. `module:Class`: import `module` and take `Class` (e.g. `my_pkg.envs:MazeEnv`);
2. `BUILTINS`: the explicit table of the environments shipped in `envs/`;
3. the `treetrain.envs` entry-point group, so an installed package can add environments by declaring

       [project.entry-points."treetrain.envs"]
       maze = "my_pkg.envs:MazeEnv"

A built-in name wins over an entry point of the same name. An unknown name raises `UnknownEnvironmentError`
listing every available name; an entry point that fails to load names the distribution that declared it.

Example:
    >>> env = make_env("calculator", max_operands=3)
    >>> type(env).__name__, "lookup" in available()
    ('CalculatorEnv', True)
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import MappingProxyType
from typing import Any

from envs.protocol import Environment
from treetrain.errors import TreetrainError

ENTRY_POINT_GROUP = "treetrain.envs"

#: The built-in environments: name -> "module:Class". Importing this module imports none of them.
BUILTINS: Mapping[str, str] = MappingProxyType(
    {
        "calculator": "envs.calculator:CalculatorEnv",
        "dataset": "envs.dataset:DatasetEnv",
        "lookup": "envs.lookup:LookupEnv",
    }
)


class UnknownEnvironmentError(TreetrainError, LookupError):
    """No environment has that name; the message lists the available ones."""


class EnvironmentLoadError(TreetrainError, ImportError):
    """A name was found but its target could not be imported, or is not an `Environment` subclass."""


@dataclass(frozen=True)
class EnvSource:
    """Where a name comes from: "builtin" or the entry point's distribution, and its target."""

    name: str
    target: str
    origin: str


def _entry_points() -> tuple[EntryPoint, ...]:
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def available() -> dict[str, EnvSource]:
    """Every registered name (built-ins, then entry points), sorted by name."""
    found: dict[str, EnvSource] = {}
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist is not None else "unknown distribution"
        found[ep.name] = EnvSource(ep.name, ep.value, f"entry point of {dist}")
    found.update({name: EnvSource(name, target, "builtin") for name, target in BUILTINS.items()})
    return dict(sorted(found.items()))


def _import_target(target: str, origin: str) -> type[Environment]:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentLoadError(f"{target!r} ({origin}) is not of the form 'module:Class'")
    try:
        obj: Any = _import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise EnvironmentLoadError(f"cannot load {target!r} ({origin}): {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise EnvironmentLoadError(f"{target!r} ({origin}) is {obj!r}, not a subclass of envs.Environment")
    return obj


def _import_module(module_name: str) -> Any:
    """Import `module_name`; a module in the current directory is found even when the entry point (the
    `treetrain` console script) did not put the current directory on `sys.path`."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        top = module_name.partition(".")[0]
        if exc.name != top or cwd in sys.path or "" in sys.path:
            raise
        if not (Path(cwd, f"{top}.py").is_file() or Path(cwd, top).is_dir()):
            raise
        sys.path.append(cwd)
        return importlib.import_module(module_name)


def resolve(name: str) -> type[Environment]:
    """The environment class for a built-in name, an entry-point name or a `module:Class` string."""
    if ":" in name:
        return _import_target(name, "given on the command line")
    sources = available()
    source = sources.get(name)
    if source is None:
        listing = ", ".join(f"{n} ({s.origin})" for n, s in sources.items()) or "none"
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}. Available: {listing}. "
            "Or pass 'module:Class' to load a class directly."
        )
    return _import_target(source.target, source.origin)


def make_env(name: str, **kwargs: Any) -> Environment:
    """Resolve `name` and instantiate it with `kwargs`."""
    return resolve(name)(**kwargs)
