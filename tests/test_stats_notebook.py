"""examples/heads.ipynb runs in a real Jupyter kernel (nbclient) and shows what it says: the head
table, the induction head in layer 1, HTML renderings of the table, the capture and a record."""

from __future__ import annotations

import os
from pathlib import Path

import ipykernel  # noqa: F401  # the kernel the notebook runs in (a dev dependency: missing is a failure, not a skip)
import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", ""))
        data = o.get("data", {})
        out.append(data.get("text/plain", ""))
        out.append(data.get("text/html", ""))
    return "".join(out)


def test_heads_notebook_executes_and_finds_the_induction_head(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    nb = nbformat.read(ROOT / "examples" / "heads.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    table, found, grid, one, cap_html, rec_html = (_text(c) for c in code[1:7])
    assert "| layer | name" in table and "induction" in table
    assert "induction head: layer 1" in found and "'induction'" in found
    assert "<table" in grid and "induction" in grid
    assert "Record(#1 'blocks.1'" in one
    assert "Capture(2 of 2 attention calls" in cap_html and "<table" in cap_html
    assert "<svg" in rec_html and "Record #1" in rec_html
