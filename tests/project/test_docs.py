"""The documentation stays true: links and cited paths exist, every Python example runs, the generated
configuration reference is current, the README stays short, and every docstring example passes."""

from __future__ import annotations

import ast
import doctest
import importlib
import re
import subprocess
from pathlib import Path

import pytest
from support.pages import FENCE
from support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "trees" / "README.md", *(REPO / "docs").glob("*.md")])
RUN_ELSEWHERE = {REPO / "docs" / "models.md": "tests/project/test_models_page.py"}
"""Pages whose blocks write files and run CLI steps: their own test runs them in a scratch directory."""
FENCED_PAGES = [
    p for p in PAGES if (p.parent.name == "docs" or p == REPO / "README.md") and p not in RUN_ELSEWHERE
]
NOT_MODULES = {"treetrain.envs"}  # the entry-point group environments register under
REGENERATE = "python -m treetrain.train.config_docs docs/configuration.md"


def _top_level_names() -> set[str]:
    """Top-level names the repository tracks. Untracked output such as `runs/` (written by `make demo`) is
    not part of it, so a page may cite `runs/<name>/...` as a pattern without that path having to exist."""
    try:
        tracked = subprocess.run(
            ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        ignored = {"runs", "build", "dist"}
        return {
            p.name
            for p in REPO.iterdir()
            if p.name not in ignored and (not p.name.startswith(".") or p.name == ".ci")
        }
    return {name.split("/", 1)[0] for name in tracked}


TOP_LEVEL = _top_level_names()

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE = re.compile(r"`([^`\n]+)`")


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)


def _prose(text: str) -> str:
    """The page without its fenced blocks (links and paths inside code blocks are examples, not citations)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.

    >>> slug("Memory: the ledger, bounded retention and the planner (`treetrain plan`)")
    'memory-the-ledger-bounded-retention-and-the-planner-treetrain-plan'
    """
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", _prose(page.read_text()), re.M)}


def _exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return any(REPO.glob(path))
    return (REPO / path).exists()


def _module_names(source: str) -> set[str]:
    """Names a module defines or imports at its top level."""
    names: set[str] = set()
    body = ast.parse(source).body
    body += [inner for node in body if isinstance(node, ast.If) for inner in node.body]
    for node in body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _module_ref_ok(ref: str) -> bool:
    """`pkg.module` or `pkg.module.Name[.attr]`: the longest module prefix is a file that defines `Name`."""
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return i == len(parts) or parts[i] in _module_names(candidate.read_text())
    return False


def path_problems(page: Path) -> list[str]:
    """Relative links that do not resolve (files and #anchors) and cited repo paths or modules that do not exist."""
    text = _prose(page.read_text())
    problems = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            problems.append(f"{_rel(page)}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{_rel(page)}: link to {target}: no heading with that anchor")
    for span in _CODE.findall(text):
        span = span.strip()
        path = span.split("::")[0].rstrip("/").split()[0] if span.split() else ""
        first = path.split("/")[0]
        if "/" in path and first in TOP_LEVEL and not _exists(path):
            problems.append(f"{_rel(page)}: cites {path}, which is not in the repository")
        elif (
            re.fullmatch(r"(treetrain|envs)(\.\w+)+", span)
            and span not in NOT_MODULES
            and not _module_ref_ok(span)
        ):
            problems.append(f"{_rel(page)}: cites {span}, which no module defines")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_and_cited_paths_exist(page: Path) -> None:
    assert path_problems(page) == []


def test_the_link_check_catches_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text(
        "# Probe\n[ok](#probe) [gone](no-such-page.md) [anchor](#nowhere) `treetrain/replay/nothing.py` "
        "`treetrain.replay.nope` `treetrain/replay/flat_reference.py` `treetrain.replay.verify.noise_floor`\n"
    )
    assert len(path_problems(page)) == 4, path_problems(page)


OUTSIDE_DOCUMENTS = r"\b" + "DESIGN" + r"\.md\b|shared/" + "reference"
"""The original architecture note and its essay live outside the repository; built from parts so that this
file does not cite them either."""


def test_no_file_cites_a_document_outside_the_repository() -> None:
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True)
    tracked_names = tracked.stdout.split()
    offenders = []
    for name in tracked_names:
        if name.endswith((".py", ".md", ".ipynb", ".toml")):
            text = (REPO / name).read_text(errors="replace")
            if re.search(OUTSIDE_DOCUMENTS, text):
                offenders.append(name)
    assert offenders == [], "these cite the architecture note outside the repository; use docs/design.md"


def python_blocks(page: Path) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == "python"]


@pytest.mark.parametrize("page", FENCED_PAGES, ids=_rel)
def test_python_examples_run(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ```python block of a page runs, in order, in one namespace per page, from the repository root."""
    monkeypatch.chdir(REPO)
    namespace: dict[str, object] = {"__name__": f"docs_example_{page.stem}"}
    for i, block in enumerate(python_blocks(page)):
        code = compile(block, f"{_rel(page)} (python block {i + 1})", "exec")
        exec(code, namespace)


def test_configuration_reference_is_current() -> None:
    from treetrain.train.config_docs import render

    on_disk = (REPO / "docs" / "configuration.md").read_text()
    assert on_disk == render(), f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`"


def test_readme_is_short() -> None:
    size = len((REPO / "README.md").read_bytes())
    assert size < 10 * 1024, f"README.md is {size} bytes; keep it under 10 KB and move detail into docs/"


def _doctest_modules() -> list[str]:
    out = []
    for base in ("treetrain", "envs"):
        for p in sorted((REPO / base).rglob("*.py")):
            if ">>>" in p.read_text():
                parts = p.relative_to(REPO).with_suffix("").parts
                out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


@pytest.mark.parametrize("name", _doctest_modules())
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


@pytest.mark.parametrize(
    "script", [p.name for p in sorted((REPO / "bench").glob("*.py")) if ">>>" in p.read_text()]
)
def test_benchmark_docstring_examples(script: str) -> None:
    """The bench scripts are no package; each is loaded from its path (`support.scripts`)."""
    module = load_script(f"bench/{script}", f"bench_{script.removesuffix('.py')}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted and result.failed == 0
