"""Every notebook in notebooks/ runs top to bottom on the real model (small N)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

pytestmark = [pytest.mark.notebook, pytest.mark.integration, pytest.mark.slow]


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_probes.ipynb", "02_attention_entropy_gtd.ipynb", "03_saobp.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, smol, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("INTERP_NB_N", os.environ.get("INTERP_NB_N", "4"))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    # every figure cell produced a plotly output
    figure_outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figure_outputs, "the notebook showed no figure"
