"""Dependencies run one way: a package imports only packages listed before it in `LAYERS`.

The order is the pipeline (docs/development.md): tree data, the loss on it, the model, the replay engine that
replays trees through the model, the memory model that prices the engine, then everything that drives a
run. A lower layer reaching up (say `replay` importing `train`) is a failing test, found by reading every
`import` in the source, including ones inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS = (
    "errors",
    "lazy",
    "bytesize",
    "diskfull",
    "runfs",
    "io",
    "lifetime",
    "jsonfile",
    "trajectory",
    "envs",
    "tree",
    "loss",
    "models",
    "replay",
    "memory",
    "viz",
    "rollout",
    "distributed",
    "benchmark",
    "assets",
    "update",
    "train",
    "cli",
    "api",
    "__init__",
    "__main__",
)


def _unit(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return "envs" if rel.parts[0] == "envs" else rel.with_suffix("").parts[1]


def _imported_units(source: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "envs":
                found.add("envs")
            elif parts[0] == "treetrain" and len(parts) > 1:
                found.add(parts[1])
    return found


def _sources() -> list[tuple[str, str, str]]:
    """(where, package, source) for every module of the two packages."""
    paths = sorted([*(ROOT / "treetrain").rglob("*.py"), *(ROOT / "envs").rglob("*.py")])
    return [(str(p.relative_to(ROOT)), _unit(p), p.read_text(encoding="utf-8")) for p in paths]


def _upward_imports(sources: list[tuple[str, str, str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for where, unit, source in sources:
        assert unit in rank, f"{where}: package {unit!r} has no place in LAYERS"
        for target in sorted(_imported_units(source) - {unit}):
            if rank.get(target, len(LAYERS)) > rank[unit]:
                bad.append(f"{where} ({unit}) imports {target}")
    return bad


def test_no_package_imports_a_higher_layer() -> None:
    assert _upward_imports(_sources()) == []


SAME_CONCEPT = {"__init__.py", "env.py"}
"""File names that may repeat: package markers, and each built-in environment's `env.py` (one concept)."""


def _name_collisions(paths: list[str]) -> list[str]:
    by_name: dict[str, list[str]] = {}
    for path in paths:
        by_name.setdefault(Path(path).name, []).append(path)
    return sorted(
        f"{name}: {', '.join(sorted(where))}"
        for name, where in by_name.items()
        if len(where) > 1 and name not in SAME_CONCEPT
    )


def test_no_two_modules_share_a_file_name() -> None:
    assert _name_collisions([where for where, _, _ in _sources()]) == []


def test_the_name_check_catches_a_collision() -> None:
    paths = [where for where, _, _ in _sources()]
    assert _name_collisions([*paths, "treetrain/viz/tree_replay.py"]) == [
        "tree_replay.py: treetrain/replay/tree_replay.py, treetrain/viz/tree_replay.py"
    ]


def test_the_check_catches_an_upward_import_inside_a_function() -> None:
    probe = ("treetrain/replay/probe.py", "replay", "def f():\n    from treetrain.train.loop import run\n")
    assert _upward_imports([*_sources(), probe]) == ["treetrain/replay/probe.py (replay) imports train"]
