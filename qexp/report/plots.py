"""The report's plots: perplexity vs size and perplexity vs decode speed, each with one Pareto front per target.

How they stay legible:
- No text on the data. Each point gets its own colour and marker and one legend entry beside the axes with its
  perplexity; points whose markers would overlap (identical ones included) share one marker and one entry naming
  all of them. Label parts every point shares go in the legend's title.
- A collapsed configuration (perplexity > COLLAPSE_FACTOR x the median of the plot's points, e.g. 8a8w on SmolLM2 at
  ~1e5 among 25-60) does not set the y axis: the axis is clipped to the other points (linear unless they span more
  than LOG_SPAN x) and each collapsed point is an upward triangle on the top edge with its value written under it,
  one row per point, in headroom kept free of data.
- Filled markers and a line: the Pareto front of each target, over the points not collapsed (a collapsed
  configuration is no trade-off worth drawing a line to); hollow markers are dominated.
- Units on the axes; a caption under the figure: perplexity kind, text, windows, what size / speed mean.

replot() redraws a committed report's plots from its CSV (and, for CSVs older than the text/window columns, the
perplexity note of its .md), for reports whose MLflow runs are not in this machine's store.

Drawing one figure (scales, fronts, markers, notes, legend, caption): qexp/report/plot_figure.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import pandas as pd

from qexp.report.base import Report, ReportError
from qexp.report.plot_figure import draw_figure
from qexp.report.query import LEGACY_NAMES
from qexp.report.table import EMULATED

PLOTS = ("ppl_vs_size", "ppl_vs_speed")
COLLAPSE_FACTOR = 10.0  # > 10x the median perplexity: the configuration broke, its value is not a trade-off
# text: the evaluation text, where a mixed report (--allow-mixed) holds several; calibration.text_source: domain shift
LABEL_PARTS = ("model", "scheme", "params.quant.name", "observer", "algorithm", "model_mode", "target", "text",
               "params.calibration.text_source")  # quant.name: recipes of one scheme (mixed precision) apart
EVAL_COLUMNS = ("text", "n_windows", "window_len")
# older CSVs name the deployed phase by its backend (ppl_htp, ppl_xnnpack, htp_eval_tokens): today's column <- those
LEGACY_CSV_COLUMNS = [(new.split(".", 1)[1], old.split(".", 1)[1]) for new, old in LEGACY_NAMES.items()
                      if new.startswith("metrics.")] + [("ppl_deployed", "ppl_xnnpack")]


def collapsed(ppl: np.ndarray) -> np.ndarray:
    """Which perplexities are > COLLAPSE_FACTOR x the median of all of them (never the median itself)."""
    ppl = np.asarray(ppl, float)
    return ppl > COLLAPSE_FACTOR * np.median(ppl)


def _quantized_ppl(data: pd.DataFrame) -> pd.Series:
    """The quantized model's perplexity on the full windows: QDQ, else the deployed program's, else FP (fp32 rows).

    QDQ first: a deployed phase may score only a subset of the windows (ppl_deployed_vs_qdq says how far it is)."""
    ppl = pd.Series(np.nan, index=data.index)
    for name in ("ppl_qdq", "ppl_deployed", "ppl_fp"):
        if name in data:
            ppl = ppl.fillna(data[name])
    return ppl


def _labels(data: pd.DataFrame) -> Tuple[pd.Series, str]:
    """Per row: the LABEL_PARTS that differ between rows ("-" left out); and the parts all rows share."""
    parts = [c for c in LABEL_PARTS if c in data]
    if not parts:
        return data.index.astype(str).to_series(index=data.index), ""
    text = data[parts].astype(str)
    varying = [c for c in parts if text[c].nunique() > 1] or parts[:1]
    # a value already in the label is not repeated (a recipe named like its scheme: quant=16a8w, scheme 16a8w)
    labels = text[varying].apply(lambda row: " · ".join(dict.fromkeys(v for v in row if v not in ("-", "nan")))
                                 or "-", axis=1)
    if labels.duplicated(keep=False).any() and "run_id" in data:  # same label, different runs: tell them apart
        twins = labels.duplicated(keep=False)
        labels = labels.where(~twins, labels + " (run " + data["run_id"].astype(str).str[:8] + ")")
    shared = [text[c].iloc[0] for c in parts if c not in varying and text[c].iloc[0] not in ("-", "nan")]
    return labels, " · ".join(shared)


def _points(data: pd.DataFrame, x_name: str, group: str = "target") -> Tuple[pd.DataFrame, str]:
    """x, y (perplexity), label, target (the `group` column: each has its own Pareto front and never shares one with
    another) and collapsed per plotted row, and the label parts they share."""
    ppl = _quantized_ppl(data)
    rows = data[x_name].notna() & ppl.notna() if x_name in data else ppl.isna() & False
    if not rows.any():
        return pd.DataFrame(), ""
    shown = data[rows]
    labels, shared = _labels(shown)
    points = pd.DataFrame({"x": shown[x_name].astype(float), "y": ppl[rows].astype(float), "label": labels,
                           "target": shown[group if group in shown else "target"] if "target" in shown else "?"})
    points["collapsed"] = collapsed(points["y"])
    if x_name == "decode_tok_s" and {"decode_tok_s_low", "decode_tok_s_high"} <= set(shown):
        points["x_low"] = shown["decode_tok_s_low"].astype(float).values  # the estimate's band, where it has one
        points["x_high"] = shown["decode_tok_s_high"].astype(float).values
    return points.reset_index(drop=True), shared


def _eval_setting(data: pd.DataFrame) -> str:
    """"text X, N windows x L tokens" (each setting, when a --allow-mixed report has several)."""
    if not set(EVAL_COLUMNS) <= set(data) or data[list(EVAL_COLUMNS)].isna().all().all():
        return "text and windows not recorded"
    settings = data[list(EVAL_COLUMNS)].drop_duplicates().itertuples(index=False)
    return "; ".join(f"text {t}, {_count(n)} windows x {_count(w)} tokens" for t, n, w in settings)


def _count(value) -> str:
    return "?" if pd.isna(value) else str(int(float(value)))


def _subset_text(data: pd.DataFrame) -> str:
    """Points whose perplexity is a deployed phase's on fewer tokens than the windows hold, if any."""
    if not {"deployed_eval_tokens", "ppl_deployed", "n_windows", "window_len"} <= set(data):
        return ""
    no_qdq = data["ppl_qdq"].isna() if "ppl_qdq" in data else pd.Series(True, index=data.index)
    full = pd.to_numeric(data["n_windows"], errors="coerce") * (pd.to_numeric(data["window_len"], errors="coerce") - 1)
    subset = no_qdq & data["ppl_deployed"].notna() & (data["deployed_eval_tokens"] < full)
    if not subset.any():
        return ""
    tokens = "/".join(str(int(t)) for t in sorted(set(data.loc[subset, "deployed_eval_tokens"])))
    return f" Points without a QDQ phase: the deployed program on the first {tokens} predicted tokens of those windows."


def _bits_text(data: pd.DataFrame) -> str:
    """What the bits axis counts, and the lm head's bits (said apart: on a small model it is a large share)."""
    heads = sorted({float(b) for b in data.get("weight_bits_lm_head", pd.Series(dtype=float)).dropna()})
    head = (f"the lm head at {heads[0]:g} bits in every row" if len(heads) == 1
            else "the lm head's bits differ between rows (" + ", ".join(f"{b:g}" for b in heads) + ")" if heads
            else "the lm head apart")
    return (" Size: average bits per decoder-linear weight as the HTP program stores them (an LPBQ block's 4-bit "
            f"scale counted), {head}, the embedding table not counted.")


def caption(data: pd.DataFrame, points: pd.DataFrame, speed: bool, bits: bool = False) -> str:
    """What the perplexity is and was measured on, what the x axis means, markers and emulator timings."""
    text = (f"Perplexity: token-level (lm-eval weighted_perplexity), the QDQ program where the run has one, else the "
            f"deployed program, else FP; {_eval_setting(data)}.{_subset_text(data)}")
    text += (" Speed: decode tokens/s, per speed source: `estimate <SoC>` is a phone's speed estimated from the "
             "compiled program, `what-if <SoC>` from the run's config (docs/htp-speed.md), `measured <target>` was "
             "timed there; each has its own front."
             if speed else _bits_text(data) if bits else
             " Size: the .pte where deployed, else the weights at their quantized widths.")
    text += " Filled markers (joined by a line): the Pareto front of their target; hollow: dominated."
    if speed and "x_low" in points and points["x_low"].notna().any():
        text += (" Grey bars: each estimate's 10-90% band (the speed model's held-out errors on published figures): "
                 "points whose bars overlap are not told apart by the estimate.")
    if points["collapsed"].any():
        text += (f" ▲ on the top edge: collapsed (perplexity > {COLLAPSE_FACTOR:g}x the median of the plotted "
                 "points), value written out, left out of the y axis and the fronts.")
    if speed and set(points["target"]) & EMULATED:  # x86_emulator: HTP runs from before the estimate
        text += " x86_emulator timings are emulator timings on this host, not phone speed."
    return text


def size_figure(data: pd.DataFrame):
    """Perplexity vs size (smaller is better on both), or None when no row has both. The size is the average bits
    per decoder-linear weight where every quantized row has them, else MB (the .pte where deployed, else the
    weights at their quantized widths)."""
    bits = "weight_bits_decoder" in data and data.loc[_quantized_ppl(data).notna(), "weight_bits_decoder"].notna().all()
    points, shared = _points(data, "weight_bits_decoder" if bits else "size_mb")
    if points.empty:
        return None
    axis = "average bits per decoder-linear weight, as HTP stores them" if bits else "size (MB)"
    return draw_figure(points, shared, False, axis, "Perplexity vs size", caption(data, points, speed=False, bits=bits))


def speed_figure(data: pd.DataFrame):
    """Perplexity vs decode speed (faster and lower is better), or None when no row measured decode speed."""
    points, shared = _points(data, "decode_tok_s", group="speed_source")
    if points.empty:
        return None
    sources = set(points["target"])
    estimated = all(str(t).startswith(("estimate", "what-if")) for t in sources)
    axis = "decode speed (tokens/s), estimated for a phone" if estimated \
        else "decode speed (tokens/s), by source: see the fronts"
    return draw_figure(points, shared, True, axis, "Perplexity vs decode speed",
                   caption(data, points, speed=True))


def _save(fig, out_prefix: Path, kind: str) -> Path:
    import matplotlib.pyplot as plt

    path = out_prefix.with_name(f"{out_prefix.name}_{kind}.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")  # tight: the legend beside and the caption under the axes
    plt.close(fig)
    return path


def no_speed_plot_note(data: pd.DataFrame) -> Optional[str]:
    """Why there is no perplexity-vs-speed plot, if there is none: the table's columns leave decode speed out (the
    runs may have measured it), or no run in it measured decode speed."""
    if "decode_tok_s" not in data:
        return ("No perplexity-vs-speed plot: the table's columns leave decode speed out "
                "(add decode_tok_s to --columns).")
    if data["decode_tok_s"].isna().all():
        return "No perplexity-vs-speed plot: no run in the table measured decode speed."
    return None


def plot(report: Report, out_prefix: Path) -> List[Path]:
    """<out_prefix>_ppl_vs_size.png and, when any run measured decode speed, <out_prefix>_ppl_vs_speed.png."""
    import matplotlib

    matplotlib.use("Agg")

    written = []
    for kind, draw in zip(PLOTS, (size_figure, speed_figure)):
        fig = draw(report.data)
        if fig is not None:
            written.append(_save(fig, out_prefix, kind))
    note = no_speed_plot_note(report.data)
    if note:
        report.notes.append(note)
    return written


def _with_current_names(data: pd.DataFrame) -> pd.DataFrame:
    for current, legacy in LEGACY_CSV_COLUMNS:
        if legacy in data:
            data[current] = data[current].fillna(data[legacy]) if current in data else data[legacy]
    return data


def _eval_setting_from_md(md: Path) -> dict:
    """text / n_windows / window_len from the .md's "Perplexity: ... text X, N windows x L tokens." note."""
    found = re.search(r"text (.+?), (\d+) windows x (\d+) tokens", md.read_text()) if md.exists() else None
    return dict(zip(EVAL_COLUMNS, (found[1], int(found[2]), int(found[3])))) if found else {}


def read_report_csv(csv_path: Path) -> pd.DataFrame:
    """A report's CSV under today's column names, with text / n_windows / window_len (from its .md if older)."""
    csv_path = Path(csv_path)
    if not csv_path.exists():
        raise ReportError(f"--replot: no {csv_path}", "name a report in --out-dir (results/<name>.csv)")
    data = _with_current_names(pd.read_csv(csv_path))
    if not set(EVAL_COLUMNS) <= set(data):  # a CSV older than those columns: its .md's perplexity note
        data = data.assign(**_eval_setting_from_md(csv_path.with_suffix(".md")))
    return data


def replot(csv_path: Path) -> List[Path]:
    """Redraw NAME_*.png next to NAME.csv from the CSV alone (no MLflow); NAME.md and NAME.csv are left as they are."""
    data = read_report_csv(csv_path)
    prefix = Path(csv_path).with_suffix("")
    for kind in PLOTS:  # as write(): a plot the data cannot draw must not survive
        prefix.with_name(f"{prefix.name}_{kind}.png").unlink(missing_ok=True)
    return plot(Report(table=data, data=data), prefix)
