"""Report stage: MLflow runs -> one comparison table (markdown + CSV) and plots, into results/.

    python -m qexp.report --experiment sweeps --sweep quant_grid
    python -m qexp.report --experiment sweeps --sweep observer_ablation --pivot scheme,observer,ppl_qdq
    python -m qexp.report --experiment smollm2_wikitext --filter "params.quant.name = '16a4w'" --name my_table

Runs come from `mlflow.search_runs` (FINISHED only, the latest run per config hash). Rows whose perplexities were
measured on different text, window length or window count are refused in one table unless --allow-mixed, which
then shows those columns. Timings carry their target: x86_emulator timings are emulator timings, never phone speed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import pandas as pd

from qexp.errors import QexpError
from qexp.sweep import ROLE_TAG, SWEEP_TAG

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"

# column name -> (MLflow column, header); the default table, in the seeds' order
COLUMNS: Dict[str, tuple[str, str]] = {
    "model": ("params.model.name", "model"),
    "scheme": ("scheme", "scheme"),
    "observer": ("params.observer.name", "observer"),
    "calibration": ("calibration", "calibration"),
    "kv_mode": ("kv_mode", "KV mode"),
    "target": ("target", "target"),
    "ppl_fp": ("metrics.ppl_fp", "PPL FP"),
    "ppl_qdq": ("metrics.ppl_qdq", "PPL QDQ"),
    "ppl_htp": ("metrics.ppl_htp", "PPL HTP"),
    "ppl_xnnpack": ("metrics.ppl_deployed", "PPL XNNPACK"),
    "delta_vs_fp": ("delta_vs_fp", "Δ vs FP"),
    "ttft_ms": ("metrics.ttft_ms", "TTFT ms"),
    "decode_tok_s": ("metrics.decode_tok_s", "decode tok/s"),
    "pte_mb": ("pte_mb", ".pte MB"),
}
EXTRA_COLUMNS: Dict[str, tuple[str, str]] = {
    "model_mode": ("params.backend.model_mode", "model mode"),
    "soc": ("tags.htp_soc", "SoC"),
    "weights_mb": ("metrics.weights_mb", "weights MB"),
    "ppl_qdq_sub": ("metrics.ppl_qdq_sub", "PPL QDQ (HTP subset)"),
    "ppl_htp_vs_qdq": ("metrics.ppl_htp_vs_qdq", "Δ HTP vs QDQ"),
    "top1_htp_vs_qdq": ("metrics.top1_agreement_htp_vs_qdq", "top-1 HTP vs QDQ"),
    "decoder": ("tags.decoder", "decoder"),
    "prefill_tok_s": ("metrics.prefill_tok_s", "prefill tok/s"),
    "run_id": ("run_id", "run"),
}
# What makes perplexities comparable: the same text, window length and window count.
COMPARABILITY = {
    "tags.text_sha256": "text",
    "params.eval.window_len": "window length",
    "params.eval.n_windows": "window count",
}
EMULATED = {"x86_emulator"}


class ReportError(QexpError):
    pass


@dataclass
class Report:
    table: pd.DataFrame  # display table (headers as in the seeds)
    data: pd.DataFrame  # one row per run, raw values and ids (the CSV)
    notes: List[str] = field(default_factory=list)
    pivot: Optional[pd.DataFrame] = None


# ---------------------------------------------------------------- query
def load_runs(experiment: str, sweep: Optional[str] = None, filter_string: str = "",
              tracking_uri: Optional[str] = None) -> pd.DataFrame:
    """FINISHED runs of an experiment (optionally one sweep's), newest first, one per config hash."""
    import mlflow

    from qexp.config import TrackingConfig
    from qexp.track import resolve_uri

    mlflow.set_tracking_uri(tracking_uri or resolve_uri(TrackingConfig()))
    if mlflow.get_experiment_by_name(experiment) is None:
        raise ReportError(f"no MLflow experiment {experiment!r} in {mlflow.get_tracking_uri()}",
                          "pass --experiment (see `make ui`) or --tracking-uri")
    clauses = ["attributes.status = 'FINISHED'"] + ([filter_string] if filter_string else [])
    if sweep:
        clauses.append(f"tags.`{SWEEP_TAG}` = '{sweep}'")
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string=" and ".join(clauses),
                              order_by=["attributes.start_time DESC"], output_format="pandas")
    if runs.empty:
        raise ReportError(f"no FINISHED runs in experiment {experiment!r}" + (f" for sweep {sweep!r}" if sweep else "")
                          + (f" matching {filter_string!r}" if filter_string else ""), "check the names (`make ui`)")
    if f"tags.{ROLE_TAG}" in runs:
        runs = runs[runs[f"tags.{ROLE_TAG}"] != "sweep"]
    return runs.drop_duplicates("tags.config_hash", keep="first").reset_index(drop=True)


# ---------------------------------------------------------------- table
def _column(runs: pd.DataFrame, name: str) -> pd.Series:
    return runs[name] if name in runs else pd.Series([np.nan] * len(runs), index=runs.index)


def _derived(runs: pd.DataFrame) -> pd.DataFrame:
    runs = runs.copy()
    num = lambda name: pd.to_numeric(_column(runs, name), errors="coerce")  # noqa: E731
    backend = _column(runs, "params.backend.kind").fillna("none")
    runs["calibration"] = np.where(
        (_column(runs, "params.quant.scheme").fillna("fp32") == "fp32").to_numpy(), "-",
        _column(runs, "params.calibration.name").astype(str) + " " + _column(runs, "params.calibration.limit")
        .astype(str) + "x" + _column(runs, "params.calibration.seq_len").astype(str),
    )
    runs["kv_mode"] = np.where(backend == "htp", _column(runs, "params.kv.name"), "-")  # an HTP runner setting
    # QNN observers / calibration mean nothing for runs without a QNN scheme (fp32, XNNPACK)
    fp32 = _column(runs, "params.quant.scheme").fillna("fp32") == "fp32"
    runs["params.observer.name"] = np.where(fp32, "-", _column(runs, "params.observer.name"))
    target = _column(runs, "tags.target")
    runs["target"] = target.where(target.notna(), "pytorch")
    runs["pte_mb"] = num("metrics.pte_bytes") / 1e6
    xnnpack = (backend == "xnnpack").to_numpy()
    # XNNPACK runs quantize with backend.qmode (their QNN quant group is fp32)
    runs["scheme"] = np.where(xnnpack, _column(runs, "params.backend.qmode"), _column(runs, "params.quant.name"))
    runs["delta_vs_fp"] = np.where(xnnpack, num("metrics.ppl_deployed_vs_fp"), num("metrics.ppl_qdq_vs_fp"))
    return runs


def resolve_columns(names: Optional[Sequence[str]]) -> Dict[str, tuple[str, str]]:
    if not names:
        return dict(COLUMNS)
    known = {**COLUMNS, **EXTRA_COLUMNS}
    out = {}
    for name in names:
        if name in known:
            out[name] = known[name]
        elif name.startswith(("metrics.", "params.", "tags.")):
            out[name] = (name, name.split(".", 1)[1])
        else:  # a bare metric name, e.g. kv_update_us_per_token
            out[name] = (f"metrics.{name}", name)
    return out


def build_report(runs: pd.DataFrame, columns: Optional[Sequence[str]] = None, allow_mixed: bool = False,
                 pivot: Optional[Sequence[str]] = None) -> Report:
    runs = _derived(runs)
    notes: List[str] = []
    keys = [k for k in COMPARABILITY if k in runs]
    groups = runs.groupby(keys, dropna=False).size() if keys else pd.Series(dtype=int)
    chosen = resolve_columns(columns)
    if len(groups) > 1:
        described = "; ".join(
            ", ".join(f"{COMPARABILITY[k]}={v if k != 'tags.text_sha256' else str(v)[:10]}" for k, v in
                      zip(keys, idx if isinstance(idx, tuple) else (idx,))) + f" ({n} runs)"
            for idx, n in groups.items()
        )
        if not allow_mixed:
            raise ReportError(f"runs are not comparable, their perplexities use different text/windows: {described}",
                              "narrow them with --filter / --sweep, or pass --allow-mixed to tabulate them with "
                              "those columns shown")
        notes.append(f"Mixed evaluation settings (--allow-mixed): {described}. Compare rows only within a group.")
        chosen = {"text_source": ("params.eval.text_source", "text"),
                  "window_len": ("params.eval.window_len", "window len"),
                  "n_windows": ("params.eval.n_windows", "windows"), **chosen}
    data = pd.DataFrame({name: _column(runs, source) for name, (source, _) in chosen.items()})
    for name in data:
        converted = pd.to_numeric(data[name], errors="coerce")
        if converted.notna().sum() == data[name].notna().sum() and data[name].notna().any():
            data[name] = converted
    data = data.dropna(axis=1, how="all")
    data["run_id"] = runs["run_id"].values
    data["config_hash"] = _column(runs, "tags.config_hash").values
    data["weights_mb"] = pd.to_numeric(_column(runs, "metrics.weights_mb"), errors="coerce").values
    data["target"] = runs["target"].values
    for extra in ("ppl_qdq_sub", "ppl_htp_vs_qdq", "top1_agreement_htp_vs_qdq", "htp_eval_tokens"):  # for the CSV
        if f"metrics.{extra}" in runs and extra not in data:
            data[extra] = pd.to_numeric(runs[f"metrics.{extra}"], errors="coerce").values
    # size: the deployed program where there is one, else the weights at their quantized widths
    data["size_mb"] = (pd.to_numeric(_column(runs, "metrics.pte_bytes"), errors="coerce") / 1e6).values
    data["size_mb"] = data["size_mb"].fillna(data["weights_mb"])
    # one model's rows together, largest (least quantized) first, like the seeds' tables
    sort = (["model"] if "model" in data else []) + ["size_mb"]
    data = data.sort_values(sort, ascending=[True] * (len(sort) - 1) + [False], kind="stable").reset_index(drop=True)

    table = data[[c for c in data.columns if c in chosen]].rename(columns={k: v[1] for k, v in chosen.items()})
    first = runs.iloc[0]
    notes.append(
        f"Perplexity: token-level, lm-eval `weighted_perplexity`, text {first.get('params.eval.text_source', '?')}, "
        f"{first.get('params.eval.n_windows', '?')} windows x {first.get('params.eval.window_len', '?')} tokens."
    )
    if "metrics.ppl_htp" in runs and runs["metrics.ppl_htp"].notna().any():
        tokens = sorted(set(pd.to_numeric(runs["metrics.htp_eval_tokens"], errors="coerce").dropna().astype(int)))
        notes.append(f"PPL HTP is measured on the first {'/'.join(map(str, tokens))} predicted tokens of those "
                     "windows (see ppl_qdq_sub / ppl_htp_vs_qdq in the CSV for QDQ on the same subset).")
    if "delta_vs_fp" in chosen:
        notes.append("Δ vs FP: PPL QDQ / PPL FP - 1 (XNNPACK rows: PPL XNNPACK / PPL FP - 1), same windows.")
    if (runs["target"] == "cpu").any():
        notes.append("target=cpu: ExecuTorch XNNPACK .pte on this machine's CPU (real speed; scheme = backend.qmode, "
                     "PPL XNNPACK from running the .pte on the same windows as PPL FP).")
    if runs["target"].isin(EMULATED).any():
        notes.append("target=x86_emulator: HTP graphs run on the QNN HTP emulator on this x86 host; its TTFT and "
                     "tok/s are emulator timings, not phone speed.")
    if "pytorch" in set(runs["target"]):
        notes.append("target=pytorch: no deployment backend; PPL FP and PPL QDQ (the fake-quantized program) run in PyTorch.")
    pivot_table = None
    if pivot:
        if len(pivot) != 3:
            raise ReportError(f"--pivot {','.join(pivot)}", "pass three names: index,columns,values")
        index, cols, values = pivot
        missing = [p for p in pivot if p not in data]
        if missing:
            raise ReportError(f"--pivot: no column {', '.join(missing)} in the table",
                              f"choose from {', '.join(data.columns)} (add them with --columns)")
        pivot_table = data.pivot_table(index=index, columns=cols, values=values, aggfunc="first")
    return Report(table=table, data=data, notes=notes, pivot=pivot_table)


# ---------------------------------------------------------------- plots
def pareto_front(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of points not dominated when larger x and smaller y are better, ordered by x."""
    order = np.argsort(-x)
    front, best = [], np.inf
    for i in order:
        if y[i] < best:
            front.append(i)
            best = y[i]
    return np.array(front[::-1], dtype=int)


def _deployed_ppl(data: pd.DataFrame) -> pd.Series:
    """The quantized model's perplexity on the full windows: QDQ, else the XNNPACK .pte's, else FP (fp32 rows)."""
    ppl = pd.Series(np.nan, index=data.index)
    for column in ("ppl_qdq", "ppl_xnnpack", "ppl_fp"):
        if column in data:
            ppl = ppl.fillna(data[column])
    return ppl


PLOTS = ("ppl_vs_size", "ppl_vs_speed")


def plot(report: Report, out_prefix: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data, written = report.data, []
    labels = data.get("scheme", data.index.astype(str)).astype(str)
    if "observer" in data:
        labels = labels + np.where(data["observer"].astype(str) == "-", "", "/" + data["observer"].astype(str))
    ppl = _deployed_ppl(data)
    size = data["size_mb"]
    size_label = "MB: the .pte where deployed, else weights at their quantized widths"
    if ppl.notna().any() and size.notna().any():
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter(size, ppl)
        for x, y, label in zip(size, ppl, labels):
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_yscale("log")  # a collapsed scheme (e.g. 8a8w on SmolLM2) would flatten the others
        ax.set_xlabel(size_label)
        ax.set_ylabel("perplexity (log scale)")
        ax.set_title("Perplexity vs size")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_prefix.with_name(f"{out_prefix.name}_{PLOTS[0]}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    if "decode_tok_s" in data and data["decode_tok_s"].notna().any():
        rows = data["decode_tok_s"].notna() & ppl.notna()
        speed, quality = data.loc[rows, "decode_tok_s"].to_numpy(float), ppl[rows].to_numpy(float)
        targets = data.loc[rows, "target"].to_numpy() if "target" in data else np.array(["?"] * int(rows.sum()))
        fig, ax = plt.subplots(figsize=(6, 4))
        # one series and one Pareto front per target: emulator and CPU speeds are not comparable
        for target in sorted(set(targets)):
            mine = targets == target
            ax.scatter(speed[mine], quality[mine], label=f"target={target}")
            front = pareto_front(speed[mine], quality[mine])
            ax.plot(speed[mine][front], quality[mine][front], "--", label=f"Pareto front ({target})")
        for x, y, label in zip(speed, quality, labels[rows]):
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xscale("log")
        targets = sorted(set(targets))
        ax.set_xlabel("decode tok/s (log scale)")
        ax.set_ylabel("perplexity (QDQ / XNNPACK .pte)")
        title = "Perplexity vs decode speed"
        if set(targets) & EMULATED:
            title += "\n(x86 HTP emulator timings, not phone speed)"
        ax.set_title(title)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_prefix.with_name(f"{out_prefix.name}_{PLOTS[1]}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    else:
        report.notes.append("No perplexity-vs-speed plot: no run in the table measured decode speed.")
    return written


# ---------------------------------------------------------------- output
def formatted(table: pd.DataFrame) -> pd.DataFrame:
    """Display strings: perplexities to 2 decimals, relative differences in %, '-' where not measured."""
    out = table.copy().astype(object)
    for column in out:
        values = pd.to_numeric(table[column], errors="coerce")
        if column.startswith("Δ"):
            out[column] = [f"{v:+.1%}" if pd.notna(v) else "-" for v in values]
        elif values.notna().any() and table[column].dtype != object:
            out[column] = [f"{v:.4g}" if abs(v) >= 100 else f"{v:.2f}" if pd.notna(v) else "-" for v in values]
        else:
            out[column] = table[column].fillna("-")
    return out


def write(report: Report, name: str, command: str, source: str, out_dir: Path = RESULTS_DIR) -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / name
    for kind in PLOTS:  # a plot this report cannot draw must not survive from an older report of the same name
        (out_dir / f"{name}_{kind}.png").unlink(missing_ok=True)
    images = plot(report, prefix)
    lines = [f"# {name}", "", f"Generated by `{command}` from {source}.", "",
             formatted(report.table).to_markdown(index=False, stralign="right"), ""]
    if report.pivot is not None:
        lines += ["", report.pivot.to_markdown(floatfmt=".4g"), ""]
    lines += [f"- {note}" for note in report.notes]
    lines += [""] + [f"![{image.stem}]({image.name})" for image in images] + [""]
    md, csv = prefix.with_suffix(".md"), prefix.with_suffix(".csv")
    md.write_text("\n".join(lines))
    report.data.to_csv(csv, index=False)
    return [md, csv] + images


def log_to_parent(experiment: str, sweep: str, paths: List[Path]) -> Optional[str]:
    """Attach the report to the sweep's latest parent run."""
    import mlflow

    parents = mlflow.search_runs(experiment_names=[experiment], output_format="list", max_results=1,
                                 filter_string=f"tags.`{SWEEP_TAG}` = '{sweep}' and tags.`{ROLE_TAG}` = 'sweep'",
                                 order_by=["attributes.start_time DESC"])
    if not parents:
        return None
    client = mlflow.tracking.MlflowClient()
    for path in paths:
        client.log_artifact(parents[0].info.run_id, str(path), "report")
    return parents[0].info.run_id


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qexp.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="sweeps", help="MLflow experiment (default: sweeps)")
    parser.add_argument("--sweep", help="only the runs of this sweep (its tracking.sweep name)")
    parser.add_argument("--filter", default="", help="MLflow filter, e.g. \"params.observer.name = 'minmax'\"")
    parser.add_argument("--columns", help=f"comma list; default {','.join(COLUMNS)}; also "
                        f"{','.join(EXTRA_COLUMNS)} or any metric name")
    parser.add_argument("--pivot", help="index,columns,values, e.g. scheme,observer,ppl_qdq")
    parser.add_argument("--name", help="output name: results/<name>.md/.csv/_*.png (default: sweep or experiment)")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--allow-mixed", action="store_true", help="tabulate runs with different text/windows")
    parser.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI or the embedded store")
    args = parser.parse_args(argv)
    command = "python -m qexp.report " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        runs = load_runs(args.experiment, args.sweep, args.filter, args.tracking_uri)
        report = build_report(runs, args.columns.split(",") if args.columns else None, args.allow_mixed,
                              args.pivot.split(",") if args.pivot else None)
        name = args.name or args.sweep or args.experiment
        source = f"MLflow experiment `{args.experiment}`" + (f", sweep `{args.sweep}`" if args.sweep else "")
        paths = write(report, name, command, source + f" ({len(runs)} runs)", Path(args.out_dir))
        parent = log_to_parent(args.experiment, args.sweep, paths) if args.sweep else None
    except QexpError as exc:
        print(f"qexp.report: error: {exc}", file=sys.stderr)
        return 2
    print(formatted(report.table).to_string(index=False))
    print("wrote " + ", ".join(str(p) for p in paths) + (f"; attached to parent run {parent}" if parent else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
