"""The committed notebook: its cells are scripts/build_notebook.py's, and it carries their outputs (tables and
plots of the committed results), so a code host shows them. The executed-against-a-real-sweep test is in
test_sweep.py (test_notebook_executes)."""

from __future__ import annotations

import sys

import nbformat

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import build_notebook  # noqa: E402


def test_committed_notebook_is_the_built_one_with_its_outputs():
    committed = nbformat.read(build_notebook.NOTEBOOK, as_version=4)
    built = build_notebook.build()
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], \
        "notebooks/compare.ipynb is stale: run `make notebook`"
    outputs = [o for c in committed.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    tables = [o for o in outputs if "text/markdown" in o.get("data", {}) or "text/html" in o.get("data", {})]
    assert len(images) >= 2 and len(tables) >= 2, "run `make notebook`: the committed copy must carry its outputs"
    assert any("PPL QDQ" in str(o["data"].get("text/markdown", "")) for o in tables)
