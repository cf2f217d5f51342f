"""Names of a package that load on first use (PEP 562), so importing the package imports nothing heavy.

The command line reads and validates a config before torch and transformers load; packages whose modules
need torch (`replay`, `distributed`, `rollout`) and the top-level `treetrain` therefore re-export their
names lazily: `from treetrain.replay import TreeReplay` still works, and imports torch only then.

Example:
    >>> __getattr__ = lazy_names("json_demo", {"dumps": "json"})
    >>> __getattr__("dumps")({"a": 1})
    '{"a": 1}'
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `where[name]` (a module path) on first use of
    `name`, and keeps the value in the package so the next use is a plain attribute."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        module = sys.modules.get(package)
        if module is not None:
            setattr(module, name, value)
        return value

    return __getattr__
