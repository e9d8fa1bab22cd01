"""Runs -> the comparison table: columns, derived columns, comparability, notes, pivot, display strings.

Nothing here names a backend: a run's deployed phase logs the same metrics whatever it deployed to (ppl_deployed,
...), its params say which (backend.name) and its tags what it ran on (target) and was quantized with (scheme).
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

import numpy as np
import pandas as pd

from qexp.core.config import NO_QUANT
from qexp.report.columns import CSV_METRICS, EXTRA_COLUMNS, MIXED_COLUMNS, resolve_columns
from qexp.report.base import Report, ReportError, algorithms_from_params, column
from qexp.report.speeds import EMULATED, SPEEDS, speed_columns, speed_headers  # noqa: F401 - EMULATED for others



# What makes perplexities comparable: the same text, window length and window count.
COMPARABILITY = {
    "tags.text_sha256": "text",
    "params.eval.window_len": "window length",
    "params.eval.n_windows": "window count",
    # PyTorch's CPU kernels (AVX2, AVX512, ...): QDQ perplexities differ by ~1% between them (qexp/__init__.py)
    "tags.numerics.cpu_capability": "CPU kernels",
    # MKL's code branch (MKL_CBWR): another branch gives other sgemm bits on the same CPU (qexp/__init__.py)
    "tags.numerics.mkl_cbwr": "MKL branch",
    # the CPU model: with the same kernels an Intel and an AMD host calibrate to different programs
    # (qexp/core/provenance.py)
    "tags.cpu": "CPU",
    # where the torch phases ran (qexp/core/device.py): CUDA's kernels round differently from the CPU's
    "tags.device": "device",
}
def derived_columns(runs: pd.DataFrame) -> pd.DataFrame:
    runs = runs.copy()
    num = lambda name: pd.to_numeric(column(runs, name), errors="coerce")  # noqa: E731
    # QNN observers / calibration mean nothing for runs without a QNN scheme (fp32; XNNPACK quantizes by its qmode)
    fp32 = (column(runs, "params.quant.scheme").fillna(NO_QUANT) == NO_QUANT).to_numpy()
    sampling = column(runs, "params.calibration.sampling").fillna("contiguous").astype(str)
    runs["calibration"] = np.where(
        fp32, "-", column(runs, "params.calibration.name").astype(str) + " "
        + column(runs, "params.calibration.limit").astype(str) + "x"
        + column(runs, "params.calibration.seq_len").astype(str)
        + np.where(sampling.str.endswith("spread"), " spread", ""),
    )
    runs["params.observer.name"] = np.where(fp32, "-", column(runs, "params.observer.name"))
    runs["algorithm"] = column(runs, "tags.algorithm").fillna(algorithms_from_params(runs)).fillna("RTN").replace(
        "", "RTN")
    runs["kv_mode"] = column(runs, "params.backend.kv_update").fillna("-")  # logged only by backends that have one
    # fake_quant (float, what the QDQ program computes) or htp_exact (eval.htp_exact: HTP's arithmetic); an
    # htp_exact run computed by an older model than this code's says which (runs from before 16-bit RMSNorms were
    # floored carry no tag: they modelled the convolutions only)
    from qexp.quant.htp_arithmetic_pass import MODELLED_OPS

    arithmetic = column(runs, "tags.qdq_arithmetic").fillna("fake_quant")
    modelled = column(runs, "tags.htp_exact_model").fillna("conv_accumulator_floor")
    older = (arithmetic == "htp_exact") & (modelled != MODELLED_OPS)
    runs["qdq_arithmetic"] = arithmetic.where(~older, "htp_exact (" + modelled + ")")
    target = column(runs, "tags.target")
    runs["target"] = target.where(target.notna(), "pytorch")
    speed_columns(runs, num)
    runs["pte_mb"] = num("metrics.pte_bytes") / 1e6
    # a run's own quantization against FP: its QDQ phase where it has one, else its deployed program
    qdq = num("metrics.ppl_qdq_vs_fp")
    runs["delta_vs_fp"] = qdq.where(qdq.notna(), num("metrics.ppl_deployed_vs_fp"))
    for bound in ("ci_low", "ci_high"):  # the interval of whichever Δ that is (runs before intervals have none)
        runs[f"delta_vs_fp_{bound}"] = num(f"metrics.ppl_qdq_vs_fp_{bound}").where(
            qdq.notna(), num(f"metrics.ppl_deployed_vs_fp_{bound}"))
    return runs


def _check_comparable(runs: pd.DataFrame, allow_mixed: bool) -> Optional[str]:
    """None when all runs share text, window length, window count, CPU kernels and CPU; else the groups (if
    --allow-mixed)."""
    keys = [k for k in COMPARABILITY if k in runs]
    groups = runs.groupby(keys, dropna=False).size() if keys else pd.Series(dtype=int)
    if len(groups) <= 1:
        return None
    described = "; ".join(
        ", ".join(f"{COMPARABILITY[k]}={v if k != 'tags.text_sha256' else str(v)[:10]}" for k, v in
                  zip(keys, idx if isinstance(idx, tuple) else (idx,))) + f" ({n} runs)"
        for idx, n in groups.items()
    )
    if not allow_mixed:
        raise ReportError(f"runs are not comparable, their perplexities use different text/windows/CPU: "
                          f"{described}",
                          "narrow them with --filter / --sweep, or pass --allow-mixed to tabulate them with "
                          "those columns shown")
    return described


def _data(runs: pd.DataFrame, chosen: Dict[str, tuple[str, str]]) -> pd.DataFrame:
    """One row per run: the chosen columns (numeric where every value is), ids and the CSV's extra metrics."""
    data = pd.DataFrame({name: column(runs, source) for name, (source, _) in chosen.items()})
    for name in data:
        converted = pd.to_numeric(data[name], errors="coerce")
        if converted.notna().sum() == data[name].notna().sum() and data[name].notna().any():
            data[name] = converted
    data = data.dropna(axis=1, how="all")
    for name in [n for n in data if chosen[n][1].startswith("Δ")]:  # each Δ's 95% interval, where runs logged one
        source = chosen[name][0]
        for bound in ("ci_low", "ci_high"):
            values = pd.to_numeric(column(runs, f"{source}_{bound}"), errors="coerce")
            if values.notna().any():
                data[f"{name}_{bound}"] = values.values
    data["run_id"] = runs["run_id"].values
    data["config_hash"] = column(runs, "tags.config_hash").values
    data["weights_mb"] = pd.to_numeric(column(runs, "metrics.weights_mb"), errors="coerce").values
    data["target"] = runs["target"].values
    data["speed_source"] = runs["speed_source"].values
    for bound in ("low", "high"):  # the decode estimate's band: the speed plot's bars
        data[f"decode_tok_s_{bound}"] = runs[f"decode_tok_s_{bound}"].values
    # the plots' labels and caption: which algorithm, and the text and windows every perplexity was measured on
    if "algorithm" not in data:
        data["algorithm"] = runs["algorithm"].values
    data["text"] = column(runs, "params.eval.text_source").values
    for name in ("n_windows", "window_len"):
        if name not in data:  # --allow-mixed shows them already
            data[name] = pd.to_numeric(column(runs, f"params.eval.{name}"), errors="coerce").values
    for extra in CSV_METRICS:
        if f"metrics.{extra}" in runs and extra not in data:
            data[extra] = pd.to_numeric(runs[f"metrics.{extra}"], errors="coerce").values
    # size: bits per decoder-linear weight (CSV_METRICS) where every row has them, else the deployed program where
    # there is one, else the weights at their quantized widths
    data["size_mb"] = (pd.to_numeric(column(runs, "metrics.pte_bytes"), errors="coerce") / 1e6).values
    data["size_mb"] = data["size_mb"].fillna(data["weights_mb"])
    # one model's rows together, largest (least quantized) first, as the field's published tables order them
    sort = (["model"] if "model" in data else []) + ["size_mb"]
    return data.sort_values(sort, ascending=[True] * (len(sort) - 1) + [False], kind="stable").reset_index(drop=True)


def _subset_note(runs: pd.DataFrame) -> Optional[str]:
    """Where a deployed phase scored fewer tokens than the windows hold (position 0 predicts nothing)."""
    num = lambda name: pd.to_numeric(column(runs, name), errors="coerce")  # noqa: E731
    tokens = num("metrics.deployed_eval_tokens")
    full = num("params.eval.n_windows") * (num("params.eval.window_len") - 1)
    subset = num("metrics.ppl_deployed").notna() & (tokens < full)
    if not subset.any():
        return None
    counts = "/".join(map(str, sorted(set(tokens[subset].astype(int)))))
    return (f"Where a deployed phase scored a subset, PPL deployed is measured on the first {counts} predicted tokens "
            "of those windows (see ppl_fp_sub / ppl_qdq_sub / ppl_deployed_vs_qdq in the CSV for FP and QDQ on the "
            "same subset).")


def _notes(runs: pd.DataFrame, chosen: Dict[str, tuple[str, str]]) -> List[str]:
    first = runs.iloc[0].get
    notes = [f"Perplexity: token-level, lm-eval `weighted_perplexity`, text {first('params.eval.text_source', '?')}, "
             f"{first('params.eval.n_windows', '?')} windows x {first('params.eval.window_len', '?')} tokens."]
    subset = _subset_note(runs)
    if subset:
        notes.append(subset)
    if "delta_vs_fp" in chosen:
        notes.append("Δ vs FP: PPL QDQ / PPL FP - 1 where the run has a QDQ phase, else PPL deployed / PPL FP - 1 "
                     "(on the windows the deployed phase scored).")
    if (runs["target"] == "cpu").any():
        notes.append("target=cpu: the deployed .pte runs on this machine's CPU (real speed; scheme = what its "
                     "backend quantized it with, PPL deployed from running the .pte).")
    if runs["target"].isin(EMULATED).any():
        notes.append("target=x86_emulator: HTP graphs run on the QNN HTP emulator on this x86 host; its TTFT and "
                     "tok/s are emulator timings, not phone speed (speed `x86_emulator`).")
    estimates = runs.loc[runs["speed_source"].str.startswith(("estimate", "what-if")), "tags.speed_source"] \
        if "tags.speed_source" in runs else pd.Series(dtype=object)
    if len(estimates):
        errors = pd.to_numeric(column(runs, "metrics.decode_tok_s_est_err"), errors="coerce").dropna()
        error = f", decode median error {100 * errors.max():.0f}% on published figures" if len(errors) else ""
        notes.append(f"speed `estimate <SoC>`: a phone's TTFT and tok/s estimated for the run's SoC from its compiled "
                     f"program ({', '.join(sorted(set(estimates.dropna())))}{error}; docs/htp-speed.md), not "
                     "measured. `measured <target>`: timed on that target. Compare speeds within one source.")
    if "pytorch" in set(runs["target"]):
        notes.append("target=pytorch: no deployment backend; PPL FP and PPL QDQ (the fake-quantized program) run in "
                     "PyTorch.")
    return notes


def _pivot(data: pd.DataFrame, pivot: Sequence[str]) -> pd.DataFrame:
    if len(pivot) != 3:
        raise ReportError(f"--pivot {','.join(pivot)}", "pass three names: index,columns,values")
    index, cols, values = pivot
    missing = [p for p in pivot if p not in data]
    if missing:
        raise ReportError(f"--pivot: no column {', '.join(missing)} in the table",
                          f"choose from {', '.join(data.columns)} (add them with --columns)")
    return data.pivot_table(index=index, columns=cols, values=values, aggfunc="first")


def build_report(runs: pd.DataFrame, columns: Optional[Sequence[str]] = None, allow_mixed: bool = False,
                 pivot: Optional[Sequence[str]] = None) -> Report:
    """runs as load_runs returns them (today's names) -> the table, its CSV data, notes and optional pivot."""
    runs = derived_columns(runs)
    chosen = resolve_columns(columns)
    mixed = _check_comparable(runs, allow_mixed)
    if mixed:
        chosen = {**MIXED_COLUMNS, **chosen}
    # eval.htp_exact runs score the QDQ phase with HTP's integer arithmetic: never side by side unlabelled
    arithmetics = runs["qdq_arithmetic"].nunique() > 1 and "qdq_arithmetic" not in chosen
    if arithmetics:
        at = list(chosen).index("scheme") + 1 if "scheme" in chosen else 0
        items = list(chosen.items())
        chosen = dict(items[:at] + [("qdq_arithmetic", EXTRA_COLUMNS["qdq_arithmetic"])] + items[at:])
    data = _data(runs, chosen)
    chosen = speed_headers(chosen, data)
    table = data[[c for c in data.columns if c in chosen]].rename(columns={k: v[1] for k, v in chosen.items()})
    # intervals ride along for formatted(): {column header: (low, high)}
    table.attrs["ci"] = {chosen[n][1]: (data[f"{n}_ci_low"], data[f"{n}_ci_high"]) for n in chosen
                         if f"{n}_ci_low" in data}
    notes: List[str] = []
    if mixed:
        notes.append(f"Mixed evaluation settings (--allow-mixed): {mixed}. Compare rows only within a group.")
    if arithmetics:
        notes.append("QDQ arithmetic: `fake_quant` rows evaluate the QDQ program in float "
                     "(PyTorch's fake quantization), "
                     "`htp_exact` rows with HTP's arithmetic as qexp models it (eval.htp_exact: the 16-bit "
                     "convolutions' accumulator floor and rounded zero-point correction, 16-bit RMSNorm outputs "
                     "floored, softmax with a 15-bit exp and floored, sigmoid at 15 bits, GELU with HTP's phi); rows "
                     "computed by an older model name it in brackets (conv_accumulator_floor: the convolutions only; "
                     "rms_norm_floor: with the norms); compare QDQ perplexities within one arithmetic.")
    notes += _notes(runs, chosen)
    if any(name.startswith("task.") and "_vs_" in name for name in chosen):
        notes.append("Δ <task>.acc…: accuracy difference in points; Δ <task>.perplexity…: ratio − 1 (paired by item).")
    if table.attrs["ci"]:
        notes.append("[low, high]: 95% interval of a Δ, paired bootstrap over the evaluation windows (32-token blocks "
                     "where a phase scored fewer than 8 windows; qexp/eval/uncertainty.py). `~`: the interval spans "
                     "zero, the difference is within the noise.")
    pivot_table = _pivot(data, pivot) if pivot else None
    return Report(table=table, data=data, notes=notes, pivot=pivot_table)


def delta_cell(value: float, low: float, high: float) -> str:
    """`+89.7% [+84.1, +95.6]`; `~` marks an interval that spans zero."""
    if pd.isna(value):
        return "-"
    if pd.isna(low) or pd.isna(high):
        return f"{value:+.1%}"
    return f"{value:+.1%} [{100 * low:+.1f}, {100 * high:+.1f}]" + (" ~" if low <= 0 <= high else "")


def _points_cell(value: float, low: float, high: float) -> str:
    """An accuracy difference (a fraction) in points: `-13.9 pt [-17.2, -10.6]`; `~` as for a Δ."""
    if pd.isna(value):
        return "-"
    shown = f"{100 * value:+.1f} pt"
    return shown if pd.isna(low) or pd.isna(high) else f"{shown} [{100 * low:+.1f}, {100 * high:+.1f}]" + (
        " ~" if low <= 0 <= high else "")


def formatted(table: pd.DataFrame) -> pd.DataFrame:
    """Display strings: perplexities to 2 decimals, relative differences in %, '-' where not measured."""
    out = table.copy().astype(object)
    intervals = table.attrs.get("ci", {})
    for name in out:
        values = pd.to_numeric(table[name], errors="coerce")
        if name.startswith("Δ"):
            low, high = intervals.get(name, ([np.nan] * len(values), [np.nan] * len(values)))
            cell = _points_cell if re.search(r"\.acc(_norm)?_", name) else delta_cell  # accuracy: in points
            out[name] = [cell(v, lo, hi) for v, lo, hi in zip(values, low, high)]
        elif values.notna().any() and table[name].dtype != object:
            out[name] = [f"{v:.4g}" if abs(v) >= 100 else f"{v:.2f}" if pd.notna(v) else "-" for v in values]
        else:
            out[name] = table[name].fillna("-")
    return out
