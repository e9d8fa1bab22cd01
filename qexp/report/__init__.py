"""Report stage: MLflow runs -> one comparison table (markdown + CSV) and plots, into results/.

    python -m qexp.report --experiment sweeps --sweep quant_grid      (see qexp.report.cli for the flags)

query: load_runs (MLflow, legacy names -> today's); table: columns, build_report, formatted; plots: the Pareto plots;
cli: results/ output, the sweep's parent-run artifacts, main; compare_runs: two runs side by side (--compare).
"""

from qexp.report.base import Report, ReportError
from qexp.report.cli import RESULTS_DIR, log_to_parent, main, write
from qexp.report.compare_runs import RunComparison, compare_runs
from qexp.report.plot_figure import pareto_front
from qexp.report.plots import PLOTS, plot
from qexp.report.query import LEGACY_NAMES, load_runs, with_current_names
from qexp.report.columns import COLUMNS, EXTRA_COLUMNS, resolve_columns
from qexp.report.table import COMPARABILITY, build_report, formatted

__all__ = [
    "COLUMNS", "COMPARABILITY", "EXTRA_COLUMNS", "LEGACY_NAMES", "PLOTS", "RESULTS_DIR", "Report", "ReportError",
    "RunComparison", "build_report", "compare_runs", "formatted", "load_runs", "log_to_parent", "main",
    "pareto_front", "plot", "resolve_columns", "with_current_names", "write",
]
