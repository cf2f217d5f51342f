"""Both notebooks execute top to bottom (nbclient, the venv's own python3 kernel), so they cannot rot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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
