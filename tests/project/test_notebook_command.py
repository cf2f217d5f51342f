"""The documented way to open the notebooks works from a fresh clone: `make notebook` installs the
`notebook` extra (JupyterLab, kept out of `dev`) into the venv and starts `jupyter lab` with
`TREETRAIN_TREES` set, and the docs and the notebook name that command. The notebooks themselves run in
`test_notebooks.py`."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def _recipe(target: str) -> list[str]:
    """The recipe lines of `target` in the Makefile."""
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", MAKEFILE, re.M)
    assert match, f"no {target} target in the Makefile"
    return [line.strip() for line in match.group(1).splitlines()]


def test_the_notebook_extra_holds_jupyterlab_and_dev_does_not() -> None:
    extras = _extras()
    assert "jupyterlab" in _requirement_names(extras["notebook"])
    assert "jupyterlab" not in _requirement_names(extras["dev"])  # make venv does not fetch it
    assert "ipykernel" in _requirement_names(extras["dev"])  # the kernel the lab's notebooks run on


def test_make_notebook_installs_the_extra_and_starts_jupyter_lab_on_the_notebooks() -> None:
    assert re.search(r"^\.PHONY:.*\bnotebook\b", MAKEFILE, re.M)
    (start,) = _recipe("notebook")
    assert start.endswith("$(BIN)/jupyter lab notebooks") and "TREETRAIN_TREES=" in start, start
    assert re.search(r"^notebook: \$\(VENV\)/\.notebook$", MAKEFILE, re.M)
    assert _recipe("$(VENV)/.notebook") == ['$(BIN)/pip install -q -e ".[notebook]"', "touch $@"]
    assert re.search(r"^\$\(VENV\)/\.notebook: \$\(VENV\)/\.installed$", MAKEFILE, re.M)


def test_the_docs_and_the_notebook_name_the_command() -> None:
    page = " ".join((ROOT / "docs" / "training.md").read_text().split())
    assert "`make notebook TREES=runs/demo`" in page
    assert "`pip install -e '.[notebook]'`" in page
    assert "`TREETRAIN_TREES=runs/demo jupyter lab`" in page
    notebook = (ROOT / "notebooks" / "inspect_trees.ipynb").read_text()
    assert "make notebook TREES=runs/demo" in notebook and "`notebook` extra" in notebook


@pytest.mark.launch
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_notebook_runs_jupyter_lab_with_the_trees_as_an_absolute_path() -> None:
    """`make -n` prints the commands without running them: the lab starts on the given run's trees,
    whatever folder the kernel later runs in."""
    shown = subprocess.run(
        ["make", "--no-print-directory", "-n", "notebook", "TREES=runs/demo"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=True,
    ).stdout.splitlines()  # fmt: skip
    assert shown[-1] == f"TREETRAIN_TREES={ROOT}/runs/demo .venv/bin/jupyter lab notebooks", shown[-3:]
    unset = subprocess.run(
        ["make", "--no-print-directory", "-n", "notebook"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert unset[-1] == ".venv/bin/jupyter lab notebooks"  # unset: the shipped trees/


@pytest.mark.launch
@pytest.mark.skipif(
    importlib.util.find_spec("jupyterlab") is None,
    reason="the notebook extra is not installed (make notebook)",
)
def test_jupyter_lab_answers_its_version() -> None:
    jupyter = Path(sys.executable).parent / "jupyter"
    done = subprocess.run([str(jupyter), "lab", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", done.stdout.strip()), done.stdout
