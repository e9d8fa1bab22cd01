"""The text of `--compare` on the terminal (qexp/report/compare_runs.py builds the comparison): the two runs, loud flags
where a difference means nothing, the params that differ, the metrics with B-A and B/A-1 (and their intervals), notes.
"""

from __future__ import annotations

import textwrap
from typing import List, Sequence

import numpy as np

from qexp.report.compare_fetch import RunSummary
from qexp.report.compare_runs import RELATIVE, MetricRow, RunComparison
from qexp.report.table import delta_cell

WIDTH = 118  # flags and notes wrap here; the tables are as wide as their values


def _number(value: float, sign: str = "", digits: int = 6) -> str:
    return "-" if np.isnan(value) else f"{value:{sign}.{digits}g}"


def _cells(row: MetricRow) -> List[str]:
    """metric, A, B, B-A, B/A-1, flag. A relative metric is in %, its B-A in percentage points, no B/A-1."""
    difference = row.b - row.a
    if RELATIVE.match(row.name):
        a, b = delta_cell(row.a, *row.a_interval), delta_cell(row.b, *row.b_interval)
        return [row.name, a, b, "-" if np.isnan(difference) else f"{100 * difference:+.2f} pp", "", row.flag]
    ratio = row.b / row.a - 1 if row.a and not np.isnan(row.a) else np.nan
    return [row.name, _number(row.a), _number(row.b), _number(difference, "+", 4), delta_cell(ratio, *row.paired),
            row.flag]


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> List[str]:
    """The first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(str(cells[i])) for cells in [header, *rows]) for i in range(len(header))]
    line = lambda cells: indent + "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(cells).rstrip() for cells in [header, *rows]]


def _run_lines(label: str, run: RunSummary) -> List[str]:
    lines = [f"{label}  {run.run_id}  {run.name}  {run.status}  {run.started}  (experiment {run.experiment})"]
    return lines + ([f"   ! {run.warning}"] if run.warning else [])


def _wrapped(text: str) -> List[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def render(comparison: RunComparison) -> str:
    c = comparison
    lines = _run_lines("A", c.a) + _run_lines("B", c.b)
    if c.not_comparable:
        lines += _wrapped(f"NOT COMPARABLE: different text/window length/window count/CPU ({c.not_comparable}): "
                          "the differences of what was measured on the windows mean nothing")
    if c.timing_differs:
        lines += _wrapped(f"TIMINGS NOT COMPARABLE: {c.timing_differs}")
    lines += ["", f"params that differ ({len(c.params_differ)}; {c.params_equal} equal; tracking/cache params "
                  "ignored):"]
    lines += _aligned(["param", "A", "B"], c.params_differ) if c.params_differ else ["  (none)"]
    lines += ["", "metrics:"]
    lines += _aligned(["metric", "A", "B", "B-A", "B/A-1", ""], [_cells(row) for row in c.metrics])
    if c.metrics_equal:
        lines += [f"equal in both: {', '.join(c.metrics_equal)}"]
    for note in c.notes:
        lines += [""] + _wrapped(note)
    return "\n".join(lines)
