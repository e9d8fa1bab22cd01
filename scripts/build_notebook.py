"""Write notebooks/compare.ipynb from the cells below, execute it against the committed results (and, when
QEXP_EXPERIMENT is set, an MLflow sweep) and save it with its outputs: `make notebook`.

The cells live here, not only in the .ipynb, so that a change to them is a readable diff; the committed notebook is
this script's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "compare.ipynb"

CELLS = [
    ("markdown", """\
# Compare quantization runs

Two views of the same kind of table:

1. **The committed results** (`results/*.md`, `.csv`, `.png`): what the README quotes, as `python -m qexp.report`
   wrote them. Choose which with `QEXP_RESULTS` (comma list of names; default `quant_grid,algorithms_spread`).
2. **A sweep from MLflow**: set `QEXP_EXPERIMENT` (and `QEXP_SWEEP`, `MLFLOW_TRACKING_URI`; default: this repo's
   embedded store `mlruns.db`) to load runs with the report's own query (`qexp.report.load_runs`: FINISHED runs,
   the latest per config, refused when their text or windows differ) and draw the table and plots.

`make notebook` re-executes this notebook and saves it with its outputs; the test suite executes it against a small
real sweep."""),
    ("code", """\
import os
import re
import tempfile
from pathlib import Path

import pandas as pd
from IPython.display import Image, Markdown, display

from qexp.report import build_report, formatted, load_runs, plot

RESULTS_DIR = Path("results")
RESULTS = [n for n in os.environ.get("QEXP_RESULTS", "quant_grid,algorithms_spread").split(",") if n]
EXPERIMENT = os.environ.get("QEXP_EXPERIMENT")  # unset: only the committed results
SWEEP = os.environ.get("QEXP_SWEEP") or None
TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")  # None: the embedded store"""),
    ("markdown", "## 1. The committed results"),
    ("code", """\
for name in RESULTS:
    text = (RESULTS_DIR / f"{name}.md").read_text()
    images = re.findall(r"!\\[[^\\]]*\\]\\(([^)]+)\\)", text)
    display(Markdown(re.sub(r"!\\[[^\\]]*\\]\\([^)]+\\)\\n?", "", text)))  # the report: table and notes
    for image in images:
        display(Image(filename=str(RESULTS_DIR / image)))"""),
    ("code", """\
# The same rows as data (one per run, raw values and MLflow run ids), for your own cuts:
data = pd.read_csv(RESULTS_DIR / f"{RESULTS[-1]}.csv")
data.filter(regex=r"^(scheme|algorithm|observer|ppl_|delta|Δ|run_id)").head(12)"""),
    ("markdown", "## 2. A sweep from MLflow"),
    ("code", """\
if EXPERIMENT:
    runs = load_runs(EXPERIMENT, SWEEP, tracking_uri=TRACKING_URI)
    report = build_report(runs)
    print(f"{len(runs)} runs of experiment {EXPERIMENT!r}, sweep {SWEEP!r}")
    display(Markdown(formatted(report.table).to_markdown(index=False)))
    for image in plot(report, Path(tempfile.mkdtemp()) / (SWEEP or EXPERIMENT)):
        display(Image(filename=str(image)))
    for note in report.notes:
        print("-", note)
else:
    print("QEXP_EXPERIMENT is not set: no MLflow sweep loaded (see the first cell).")"""),
    ("code", """\
# Everything MLflow has on these runs (params.*, metrics.*, tags.*):
runs.filter(regex=r"^(run_id|params\\.quant\\.name|metrics\\.ppl_|metrics\\.time_)").head() if EXPERIMENT else None"""),
]


def build() -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    make = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
    notebook.cells = [make[kind](source) for kind, source in CELLS]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return notebook


def execute(notebook: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(REPO)}}).execute()
    return notebook


def main() -> int:
    notebook = execute(build())
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    if errors:
        print(f"build_notebook: error: a cell failed: {errors[0].get('ename')}: {errors[0].get('evalue')}",
              file=sys.stderr)
        return 1
    nbformat.write(notebook, NOTEBOOK)
    print(f"wrote {NOTEBOOK.relative_to(REPO)} ({NOTEBOOK.stat().st_size // 1024} KiB, with outputs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
