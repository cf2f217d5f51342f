"""No import cycle between the modules of a package: within each folder of `treetrain/` and `envs/`, the
modules import one another one way. A cycle (`a` imports `b`, `b` imports `a`, directly or around a longer
loop) means neither can be read, tested or replaced without the other, so they are one concept in two
files, or a shared piece that wants its own module. Imports are read with `ast`, at module level and
inside functions alike (a deferred import is still a dependency; it only hides the loop from Python). The
package's `__init__` re-exports its names lazily and is not a member of any loop checked here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _sources() -> dict[str, str]:
    """Dotted module name -> source, for every module of the two packages (package `__init__`s left out)."""
    paths = sorted([*(ROOT / "treetrain").rglob("*.py"), *(ROOT / "envs").rglob("*.py")])
    return {_module_name(p): p.read_text(encoding="utf-8") for p in paths if p.name != "__init__.py"}


def _imports(source: str, modules: Iterable[str]) -> set[str]:
    """The modules among `modules` that `source` imports, wherever the import statement stands."""
    known = set(modules)
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def _cycles(sources: Mapping[str, str]) -> list[list[str]]:
    """Each loop of imports between modules of one folder, as the sorted modules on it (Tarjan's SCCs)."""
    edges = {
        name: sorted(
            t for t in _imports(src, sources) if t != name and t.rpartition(".")[0] == name.rpartition(".")[0]
        )
        for name, src in sources.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_package_has_an_import_cycle() -> None:
    assert _cycles(_sources()) == []


def test_the_check_finds_a_cycle_through_a_function_level_import() -> None:
    """Negative control: the base backend importing the DeepSpeed config inside a function closes a loop
    (the config's module imports the base's sibling `optim_config` only, so the loop goes through the
    DeepSpeed backend, which imports both)."""
    sources = dict(_sources())
    sources["treetrain.distributed.backend"] += (
        "\n\ndef probe():\n    from treetrain.distributed.deepspeed_backend import DeepSpeedBackend\n"
    )
    assert _cycles(sources) == [["treetrain.distributed.backend", "treetrain.distributed.deepspeed_backend"]]


def test_the_check_ignores_modules_of_other_folders() -> None:
    """A loop between two folders is the layering test's business (tests/project/test_layers.py), not this one's."""
    sources = {"treetrain.a.x": "import treetrain.b.y\n", "treetrain.b.y": "import treetrain.a.x\n"}
    assert _cycles(sources) == []
