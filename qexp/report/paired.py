"""Report options that read each run's per-window log-likelihoods (eval/per_window.csv): a Δ between two runs with
its 95% interval (`--paired-vs algorithm=RTN`), and how many windows would resolve a Δ (`--windows-needed 1`).
Both use the paired bootstrap of qexp/eval/uncertainty.py over the evaluation windows the runs share."""

from __future__ import annotations

import functools
import io
import os
from typing import Dict, Optional

import numpy as np
import pandas as pd

from qexp.eval.uncertainty import unit_interval, windows_needed
from qexp.report.base import Report, ReportError, column

# What must be equal for two runs to be paired: everything that defines the configuration except the compared
# column, and the very same evaluation windows.
# The per-layer overrides and custom annotations count: two round-to-nearest runs of one scheme that differ only in
# which layers an override puts at 8 bits are different baselines.
IDENTITY = ("params.model.name", "tags.scheme", "tags.weight_grid", "tags.lm_head_grid", "params.quant.overrides",
            "params.quant.custom_annotations", "params.observer.name", "calibration", "params.calibration.sampling",
            "params.backend.name", "target", "tags.eval_windows_sha256", "qdq_arithmetic")
# what a quantization recipe sets: pairing against a recipe (--paired-vs params.quant.name=...) compares recipes,
# so these may differ between the pair
QUANT_IDENTITY = ("tags.scheme", "tags.weight_grid", "tags.lm_head_grid", "params.quant.overrides",
                  "params.quant.custom_annotations")


@functools.lru_cache(maxsize=None)  # a run's artifact never changes; both options read the same runs
def per_window(run_id: str) -> Optional[pd.DataFrame]:
    """A run's eval/per_window.csv (log-likelihood per window and phase), or None where it has none."""
    import mlflow
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

    shown = os.environ.get(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name)
    os.environ[MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name] = "false"  # a bar per small file would bury the table
    try:
        return pd.read_csv(io.StringIO(mlflow.artifacts.load_text(f"runs:/{run_id}/eval/per_window.csv")))
    except Exception:  # noqa: BLE001 - a run without the artifact (older, or FP only) gets no figure
        return None
    finally:
        if shown is None:
            os.environ.pop(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name, None)
        else:
            os.environ[MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name] = shown


def _tokens(runs: pd.DataFrame) -> Dict[str, float]:
    window_len = pd.to_numeric(column(runs, "params.eval.window_len"), errors="coerce")
    return dict(zip(runs["run_id"], window_len - 1))  # position 0 of a window predicts nothing


def add_windows_needed(report: Report, runs: pd.DataFrame, resolve: float) -> None:
    header = f"windows for ±{100 * resolve:g}%"
    _add_needed_column(report, header, _windows_needed(runs, "ll_qdq", "ll_fp", resolve))
    report.notes.append(f"{header}: evaluation windows (of this length, from this text) that would make the 95% "
                        "interval of Δ vs FP (QDQ) no wider than that, estimated from the run's own per-window "
                        "log-likelihoods: the interval shrinks as 1/sqrt(windows). eval.limit=all evaluates every "
                        "window of the text.")
    # the deployed program against its QDQ program (HTP faithfulness), where the run scored whole windows on it
    deployed = _windows_needed(runs, "ll_deployed", "ll_qdq", resolve)
    if deployed:
        header = f"windows for ±{100 * resolve:g}% deployed vs QDQ"
        _add_needed_column(report, header, deployed)
        report.notes.append(f"{header}: the same for the deployed program against its own QDQ program, from the "
                            "windows the deployed phase scored (backend.eval_tokens; emulator time grows with them).")


def _windows_needed(runs: pd.DataFrame, test: str, reference: str, resolve: float) -> Dict[str, int]:
    """{run id: windows to resolve `test` vs `reference` to ±resolve} from the windows a run scored in both columns
    (a deployed phase's are the first ones, empty after them); runs with fewer than 2 such windows left out."""
    tokens, needed = _tokens(runs), {}
    for run_id in runs["run_id"]:
        frame = per_window(run_id)
        if frame is None or not {test, reference} <= set(frame) or pd.isna(tokens[run_id]):
            continue
        scored = (frame[test].notna() & frame[reference].notna()).to_numpy()
        n = windows_needed(frame[test].to_numpy()[scored], frame[reference].to_numpy()[scored],
                           int(tokens[run_id]), resolve)
        if n >= 0:
            needed[run_id] = n
    return needed


def _add_needed_column(report: Report, header: str, needed: Dict[str, int]) -> None:
    values = [needed.get(r, -1) for r in report.data["run_id"]]
    report.data[header] = values
    report.table[header] = [v if v >= 0 else "-" for v in values]


def pairing_identity(name: str, columns) -> list:
    """The columns two runs must share to be paired when they differ in `name`: IDENTITY, less the quantization
    recipe's columns when `name` is one of them (pairing recipes against a recipe)."""
    varied = {name} | (set(QUANT_IDENTITY) if name.startswith("params.quant.") or name in QUANT_IDENTITY else set())
    return [c for c in IDENTITY if c in columns and c not in varied]


def add_paired(report: Report, runs: pd.DataFrame, spec: str) -> None:
    """`spec` = COLUMN=VALUE: each row's QDQ perplexity against the row with COLUMN == VALUE and the same identity
    (model, scheme, weight grid, overrides, observer, calibration, backend, windows, QDQ arithmetic), on the same
    windows, with its interval. A quant column (params.quant.name=recipe_llama3_2_1b) pairs recipes: the
    scheme, grids, overrides and annotations may then differ."""
    name, _, value = spec.partition("=")
    if name not in runs or not value:
        raise ReportError(f"--paired-vs {spec}", "pass COLUMN=VALUE, e.g. algorithm=RTN")
    identity = pairing_identity(name, runs.columns)
    key = lambda row: tuple(str(row.get(c)) for c in identity)  # noqa: E731
    baselines = {key(row): row["run_id"] for _, row in runs.iterrows() if str(row[name]) == value}
    if not baselines:
        raise ReportError(f"--paired-vs {spec}: no run has {name} = {value}", f"values: {sorted(set(runs[name]))}")
    tokens, header, rows = _tokens(runs), f"Δ vs {value}", {}
    for _, row in runs.iterrows():
        base = baselines.get(key(row))
        if base is None or base == row["run_id"] or pd.isna(tokens[row["run_id"]]):
            continue
        test, reference = per_window(row["run_id"]), per_window(base)
        if test is None or reference is None or "ll_qdq" not in test or "ll_qdq" not in reference:
            continue
        t, r = test["ll_qdq"].to_numpy(), reference["ll_qdq"].to_numpy()
        n_tokens = int(tokens[row["run_id"]])
        delta = float(np.expm1((r.sum() - t.sum()) / (len(t) * n_tokens)))
        rows[row["run_id"]] = (delta, unit_interval(t, r, n_tokens))
    ids = report.data["run_id"]
    report.data[header] = [rows[i][0] if i in rows else np.nan for i in ids]
    report.data[f"{header} ci_low"] = [rows[i][1].get("ci_low", np.nan) if i in rows else np.nan for i in ids]
    report.data[f"{header} ci_high"] = [rows[i][1].get("ci_high", np.nan) if i in rows else np.nan for i in ids]
    report.table[header] = report.data[header].values
    report.table.attrs.setdefault("ci", {})[header] = (report.data[f"{header} ci_low"],
                                                        report.data[f"{header} ci_high"])
    same = ("model, observer, calibration, backend, QDQ arithmetic and evaluation windows (the quantization recipe "
            "may differ)" if QUANT_IDENTITY[0] not in identity else "model, scheme, weight grid, overrides, observer, "
            "calibration, backend, QDQ arithmetic and evaluation windows")
    report.notes.append(f"{header}: PPL QDQ of the row / PPL QDQ of the run with {name} = {value} and the same "
                        f"{same}, - 1, with the 95% interval of a paired bootstrap over those windows.")
