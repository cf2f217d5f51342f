"""Finding an environment class by name. Nothing registers itself on import.

A name resolves, in this order, through:

1. `module:Class`: import `module` and take `Class` (e.g. `my_pkg.envs:MazeEnv`);
2. `BUILTINS`: the explicit table of the environments shipped in `envs/`;
3. the `treetrain.envs` entry-point group, so an installed package can add environments by declaring

       [project.entry-points."treetrain.envs"]
       maze = "my_pkg.envs:MazeEnv"

A built-in name wins over an entry point of the same name. An unknown name raises `UnknownEnvironmentError`
listing every available name (and the closest one: `calculater`, did you mean `calculator`?); an entry
point that fails to load names the distribution that declared it. A module whose own code fails at import
(it raises, has a syntax error, or calls `sys.exit`) is one `EnvironmentLoadError` line naming the module and
the error, with the traceback in a file under `TRACEBACK_DIR`.

Example:
    >>> env = make_env("calculator", max_operands=3)
    >>> type(env).__name__, "lookup" in available()
    ('CalculatorEnv', True)
    >>> resolve("calculater")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    envs.registry.UnknownEnvironmentError: unknown environment 'calculater'; did you mean 'calculator'? Available: ...
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import tempfile
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import MappingProxyType
from typing import Any

from envs.protocol import Environment
from treetrain.errors import TreetrainError

ENTRY_POINT_GROUP = "treetrain.envs"
TRACEBACK_DIR = Path(tempfile.gettempdir()) / "treetrain-env-errors"
"""Where the traceback of an environment module that fails at import goes: the run directory is not yet
claimed then (a run that never started leaves nothing in it)."""

#: The built-in environments: name -> "module:Class". Importing this module imports none of them.
BUILTINS: Mapping[str, str] = MappingProxyType(
    {
        "calculator": "envs.calculator:CalculatorEnv",
        "dataset": "envs.dataset:DatasetEnv",
        "longdoc": "envs.longdoc:LongDocEnv",
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
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(f"{exc.name}.")):
            # the module was found, and its own code imports one that is missing
            raise _failed_import(module_name, origin, exc) from None
        raise EnvironmentLoadError(f"cannot load {target!r} ({origin}): {exc}") from exc
    # the module's own code ran and failed (a raise, a syntax error, `sys.exit` at import): one line, and
    # the traceback in a file, as for environment code that fails later
    except (Exception, SystemExit) as exc:
        raise _failed_import(module_name, origin, exc) from None
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise EnvironmentLoadError(f"cannot load {target!r} ({origin}): {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise EnvironmentLoadError(f"{target!r} ({origin}) is {obj!r}, not a subclass of envs.Environment")
    return obj


def _failed_import(module_name: str, origin: str, exc: BaseException) -> EnvironmentLoadError:
    """The one-line error for an environment module whose import raised (or exited), with its traceback
    written to a file under `TRACEBACK_DIR` that the line names."""
    if isinstance(exc, SystemExit):
        what = f"called sys.exit({exc.code!r}) while being imported"
    else:
        what = f"failed while being imported: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    text = "".join(traceback.format_exception(exc))
    try:
        TRACEBACK_DIR.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f"import-{module_name[:60]}-", suffix=".log", dir=TRACEBACK_DIR)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"environment module {module_name!r} ({origin}) failed at import\n\n{text}")
        where = f"traceback in {name}"
    except OSError as problem:
        where = f"its traceback could not be saved ({problem.strerror})"
    return EnvironmentLoadError(f"environment module {module_name!r} ({origin}) {what}; {where}")


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
    if name in BUILTINS:  # a built-in name wins over an entry point of that name: no scan needed
        return _import_target(BUILTINS[name], "builtin")
    sources = available()
    source = sources.get(name)
    if source is None:
        listing = ", ".join(f"{n} ({s.origin})" for n, s in sources.items()) or "none"
        close = difflib.get_close_matches(name, list(sources), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}{hint} Available: {listing}. "
            "Or pass 'module:Class' to load a class directly."
        )
    return _import_target(source.target, source.origin)


def make_env(name: str, **kwargs: Any) -> Environment:
    """Resolve `name` and instantiate it with `kwargs`."""
    return resolve(name)(**kwargs)
