"""Both notebooks execute top to bottom (nbclient, the venv's own python3 kernel), so they cannot rot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch  # runs the treetrain CLI, a notebook kernel or a script in a subprocess

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_both_notebooks_are_checked_in_without_outputs() -> None:
    import nbformat

    assert [p.name for p in NOTEBOOKS] == ["geometry.ipynb", "inspect_trees.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code), path.name
        assert sum(c.cell_type == "markdown" for c in nb.cells) >= len(code) // 2, "explain what to look at"


@pytest.mark.skipif(importlib.util.find_spec("ipykernel") is None, reason="needs ipykernel (dev extra)")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's temporary files go here, to be counted

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(REPO)}}
    )
    client.execute()  # raises CellExecutionError with the failing cell and traceback
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})
    ]
    assert images, "the notebook drew nothing"
    assert not list(tmp_path.glob("treetrain-run-*")), "the notebook left its temporary run directory behind"


@pytest.mark.skipif(importlib.util.find_spec("ipykernel") is None, reason="needs ipykernel (dev extra)")
def test_inspect_trees_shows_your_own_trees_from_a_copy_outside_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of the notebook run from elsewhere, with `TREETRAIN_TREES` naming a directory of the user's
    own trees (none of the shipped names), runs its tree cells and shows that directory's trees."""
    import shutil

    import nbformat
    from nbclient import NotebookClient

    from treetrain.tree.format import save_trees
    from treetrain.tree.synthetic import synthetic_group

    mine = tmp_path / "my-run" / "rollouts" / "update-00000" / "trees"
    mine.mkdir(parents=True)
    for seed in range(3):
        tree = synthetic_group(prefix=12, branches=3, suffix=4, vocab=64, seed=seed, rewards=[0.0, 0.5, 1.0])
        save_trees([tree], mine / f"task-{seed}.msgpack")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(REPO / "notebooks" / "inspect_trees.ipynb", elsewhere)
    monkeypatch.setenv("TREETRAIN_TREES", str(tmp_path / "my-run"))
    nb = nbformat.read(elsewhere / "inspect_trees.ipynb", as_version=4)
    nb.cells = nb.cells[:12]  # the recorded-tree cells; the rest makes a run of its own
    client = NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(elsewhere)}}
    )
    client.execute()
    shown = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert f"showing {tmp_path / 'my-run'}" in shown
    tables = "".join(
        str(o.get("data", {}).get("text/plain", "")) for c in nb.cells for o in c.get("outputs", [])
    )
    assert "task-0" in tables and "tool_use" not in tables, tables[:2000]
