"""Narrow signatures: no constructor (`__init__`) of more than 7 parameters, no function of 10 or more, in
`treetrain/` and `envs/`. A function that needs that many inputs takes the plan or settings object they
belong to (`ReplayConfig`, `Residency`, `MergedGrad`, `ScoreForm`, ...), so a call names one concept instead
of a row of positional values. Parameters are counted as the call sees them: `self`/`cls` left out,
keyword-only ones, `*args` and `**kwargs` counted. A dataclass's generated constructor is a record's fields,
not a signature someone wrote, and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_INIT = 7
MAX_FUNCTION = 9

EXCEPTIONS = {
    "treetrain/models/recurrent_kinds.py:captured": (
        "stands in for a transformers kernel (mamba_selective_scan, mamba2_chunk_scan), which the layer's "
        "own code calls by keyword: the signature is that kernel's"
    ),
    "treetrain/models/recurrent_kinds.py:_mamba_step": (
        "stands in for transformers' mamba_selective_state_update, called by the layer by keyword"
    ),
    "treetrain/models/recurrent_kinds.py:_mamba2_step": (
        "stands in for transformers' mamba2_selective_state_update, called by the layer by keyword"
    ),
    "envs/dataset/env.py:DatasetEnv": (
        "its keywords are the user's `env.kwargs` keys (path, reward, tools, tool_kwargs, system_prompt, "
        "eval_fraction, eval_path, split), which travel to the worker process as JSON: the signature is a "
        "config schema, validated field by field"
    ),
}
"""`path:name` -> why its signature is not this project's to narrow."""


def _count(args: ast.arguments) -> int:
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    skip = 1 if names and names[0] in ("self", "cls") else 0
    return len(names) - skip + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)


def _wide(where: str, source: str) -> list[str]:
    """`where:name (n parameters)` for each too-wide constructor or function in `source`."""
    found = []
    tree = ast.parse(source)
    owners = {id(f): c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        n = _count(node.args)
        init = node.name == "__init__"
        name = owners.get(id(node), "?") if init else node.name
        if f"{where}:{name}" in EXCEPTIONS:
            continue
        if (init and n > MAX_INIT) or (not init and n > MAX_FUNCTION):
            found.append(f"{where}:{name} ({n} parameters)")
    return sorted(found)


def _sources() -> list[tuple[str, str]]:
    paths = sorted([*(ROOT / "treetrain").rglob("*.py"), *(ROOT / "envs").rglob("*.py")])
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in paths]


def test_no_wide_constructor_or_function() -> None:
    assert [w for where, src in _sources() for w in _wide(where, src)] == []


def test_every_exception_still_exists_and_is_still_wide() -> None:
    """An exception whose function was narrowed, renamed or removed is dropped from the list."""
    sources = dict(_sources())
    for key in EXCEPTIONS:
        where, _, name = key.partition(":")
        tree = ast.parse(sources[where])
        widths = [
            _count(n.args)
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
        ]
        inits = [
            _count(f.args)
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef) and c.name == name
            for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name == "__init__"
        ]
        assert (widths and max(widths) > MAX_FUNCTION) or (inits and max(inits) > MAX_INIT), key


def test_the_check_catches_a_wide_constructor_and_a_wide_function() -> None:
    """Negative control: eight constructor parameters (keyword-only included), ten function parameters
    (`*args` and `**kwargs` included) are caught; seven and nine are not."""
    probe = (
        "class Wide:\n    def __init__(self, a, b, c, d, *, e, f, g, h): ...\n"
        "class Narrow:\n    def __init__(self, a, b, c, d, e, f, g): ...\n"
        "def wide(a, b, c, d, e, f, g, h, *args, **kwargs): ...\n"
        "def narrow(a, b, c, d, e, f, g, h, i): ...\n"
    )
    assert _wide("treetrain/probe.py", probe) == [
        "treetrain/probe.py:Wide (8 parameters)",
        "treetrain/probe.py:wide (10 parameters)",
    ]
