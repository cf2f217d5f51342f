"""A repository script (`bench/*.py`, `trees/*.py`) imported as a module, so that tests can call its parts.

Scripts are not a package: they are loaded from their path, under a name of their own, and registered in
`sys.modules` (dataclasses look their module up there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str) -> ModuleType:
    """The script at `REPO/relative`, imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
