"""The exploration notebook runs top to bottom on a clean checkout (it asserts its own resume demonstration)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "explore.ipynb"


@pytest.mark.slow
def test_explore_notebook_executes_every_cell(tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        "commit it without outputs"
    )
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    printed = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "next 6 microbatches identical after restore: True" in printed
    assert "steps per epoch:" in printed and "padding:" in printed
    assert "largest distance from the target, rows: 0." in printed  # the mixture stays within one row
    assert "schedule shapes match the batches: True" in printed
    assert "rows rebuilt from provenance identical: True" in printed
