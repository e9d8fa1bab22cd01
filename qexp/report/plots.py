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
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import pandas as pd

from qexp.report.base import Report, ReportError
from qexp.report.query import LEGACY_NAMES
from qexp.report.table import EMULATED

PLOTS = ("ppl_vs_size", "ppl_vs_speed")
COLLAPSE_FACTOR = 10.0  # > 10x the median perplexity: the configuration broke, its value is not a trade-off
LOG_SPAN = 20.0  # an axis goes log only when its points span more than this factor
# text: the evaluation text, where a mixed report (--allow-mixed) holds several; calibration.text_source: domain shift
LABEL_PARTS = ("model", "scheme", "observer", "algorithm", "model_mode", "target", "text",
               "params.calibration.text_source")
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
MARKERS = ("o", "s", "D", "v", "P", "X", "*", "h", "p")  # no "^": it marks collapsed points; 9 vs 10 colours: 90 pairs
FRONT_STYLES = ("--", ":", "-.", (0, (6, 2, 1, 2)))
SAME_SPOT_PT = 5  # markers ~8 pt across: centres closer than this hide each other; one marker, one entry
NOTE_ROW_PT = 12  # one collapsed point's note per row, this far apart (8 pt text)
EVAL_COLUMNS = ("text", "n_windows", "window_len")
# older CSVs name the deployed phase by its backend (ppl_htp, ppl_xnnpack, htp_eval_tokens): today's column <- those
LEGACY_CSV_COLUMNS = [(new.split(".", 1)[1], old.split(".", 1)[1]) for new, old in LEGACY_NAMES.items()
                      if new.startswith("metrics.")] + [("ppl_deployed", "ppl_xnnpack")]


def pareto_front(x: np.ndarray, y: np.ndarray, larger_x_better: bool = True) -> np.ndarray:
    """Indices of the points no other point beats on both axes, ordered by x; smaller y is always better."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    best_x_first = -x if larger_x_better else x
    front, best_y = [], np.inf
    for i in np.lexsort((y, best_x_first)):  # ties in x: the smaller y first, the other is dominated
        if y[i] < best_y:
            front.append(i)
            best_y = y[i]
    front = np.array(front, dtype=int)
    return front[np.argsort(x[front], kind="stable")]


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
    labels = text[varying].apply(lambda row: " · ".join(v for v in row if v not in ("-", "nan")) or "-", axis=1)
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
    return points.reset_index(drop=True), shared


def _span_is_wide(values: pd.Series) -> bool:
    return values.max() / values.min() > LOG_SPAN if values.min() > 0 else False


def _y_limits(ax, kept: pd.Series, n_notes: int, log: bool) -> Tuple[float, float]:
    """Kept points from just above the bottom to below NOTE_ROW_PT-rows of headroom for the collapsed notes."""
    forward, back = (np.log10, lambda v: 10 ** v) if log else (lambda v: v, lambda v: v)
    low, high = forward(kept.min()), forward(kept.max())
    span = (high - low) or max(abs(high) * 0.1, 0.1)
    bottom = low - 0.06 * span
    axes_height_pt = ax.get_position().height * ax.figure.get_figheight() * 72
    headroom = min((NOTE_ROW_PT * n_notes + 14) / axes_height_pt, 0.6)  # fraction of the axis above the top point
    top = high + (high - bottom) * headroom / (1 - headroom)
    return back(bottom), back(top)


def _front_members(points: pd.DataFrame, larger_x_better: bool) -> set:
    """Indices (into points) on the Pareto front of their target, collapsed points left out."""
    members = set()
    for _, mine in points[~points["collapsed"]].groupby("target"):
        members.update(mine.index[pareto_front(mine["x"], mine["y"], larger_x_better)])
    return members


def _draw_fronts(ax, points: pd.DataFrame, members: set) -> None:
    on_front = points.loc[sorted(members)]
    for style, (target, mine) in zip(FRONT_STYLES * 8, on_front.groupby("target")):
        if len(mine) > 1:  # a one-point front is its filled marker
            mine = mine.sort_values("x")
            named = str(target).startswith(("estimate", "what-if", "measured", "x86"))  # a speed source, named
            ax.plot(mine["x"], mine["y"], linestyle=style, color="0.35", linewidth=1.1, zorder=2,
                    label=f"Pareto front, {target}" if named else f"Pareto front, target {target}")


def _same_spot(ax, points: pd.DataFrame) -> List[List[int]]:
    """Points (in order) whose markers would overlap, centres closer than SAME_SPOT_PT: identical points too."""
    y = np.where(points["collapsed"], ax.get_ylim()[1], points["y"])
    spots = ax.transData.transform(np.column_stack([points["x"], y])) * 72 / ax.figure.dpi
    groups: List[List[int]] = []
    for i, spot in enumerate(spots):
        near = [g for g in groups if np.hypot(*(spots[g[0]] - spot)) < SAME_SPOT_PT]
        if near:
            near[0].append(i)
        else:
            groups.append([i])
    return groups


def _draw_points(ax, points: pd.DataFrame, members: set) -> None:
    """One marker and legend entry per spot; collapsed ones on the top edge with their value written under it."""
    notes = 0
    for i, group in enumerate(_same_spot(ax, points)):
        first, colour = points.loc[group[0]], COLOURS[i % len(COLOURS)]
        label = "\n".join(f"{row.label} (ppl {row.y:.4g})" for row in points.loc[group].itertuples())
        filled = bool(members & set(group))
        style = dict(s=60, linewidths=1.5, edgecolors=colour, zorder=3,
                     facecolors=(*_rgb(colour), 0.45) if filled else "none")
        if not first["collapsed"]:
            ax.scatter([first["x"]], [first["y"]], marker=MARKERS[i % len(MARKERS)], label=label, **style)
            continue
        ax.scatter([first["x"]], [1.0], marker="^", transform=ax.get_xaxis_transform(), clip_on=False,
                   label=label + ", off scale", **style)
        notes += 1
        right_half = ax.transAxes.inverted().transform(ax.transData.transform((first["x"], 1.0)))[0] > 0.6
        ax.annotate("▲ " + label, xy=(first["x"], 1.0), xycoords=("data", "axes fraction"),
                    xytext=(-6 if right_half else 6, -NOTE_ROW_PT * notes), textcoords="offset points",
                    ha="right" if right_half else "left", va="center", fontsize=8, color=colour)


def _keep_notes_inside(ax) -> None:
    """Shift each collapsed note (the axes' only texts so far) sideways into the axes: a long one near the middle
    would otherwise run into the legend."""
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    for note in ax.texts:
        box = note.get_window_extent(renderer)
        shift_px = min(frame.x1 - box.x1, 0) or max(frame.x0 - box.x0, 0)
        note.xyann = (note.xyann[0] + shift_px * 72 / ax.figure.dpi, note.xyann[1])


def _rgb(colour: str) -> Tuple[float, float, float]:
    return tuple(int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))


def _figure(points: pd.DataFrame, shared: str, larger_x_better: bool, xlabel: str, title: str, caption: str):
    """The scatter, fronts, collapsed notes, legend beside the axes and caption under them."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    fig.subplots_adjust(left=0.12, right=0.97, top=0.9, bottom=0.2)  # fixed: _y_limits measures the axes
    kept = points.loc[~points["collapsed"], "y"]
    log_x, log_y = _span_is_wide(points["x"]), _span_is_wide(kept)
    ax.set_xscale("log" if log_x else "linear")
    ax.set_yscale("log" if log_y else "linear")
    ax.set_ylim(*_y_limits(ax, kept, int(points["collapsed"].sum()), log_y))
    ax.scatter(points["x"], np.full(len(points), kept.min()), alpha=0)  # x limits from every point, collapsed too
    ax.set_xlim(*ax.get_xlim())  # fixed before the notes pick their side
    members = _front_members(points, larger_x_better)
    _draw_points(ax, points, members)
    _draw_fronts(ax, points, members)
    _keep_notes_inside(ax)
    ax.set_xlabel(xlabel + (" (log scale)" if log_x else ""))
    ax.set_ylabel("perplexity, token-level" + (" (log scale)" if log_y else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False,
              title=f"all: {shared}" if shared else None, title_fontsize=8, alignment="left")
    ax.annotate(textwrap.fill(caption, 105), xy=(0, 0), xycoords=("axes fraction", ax.xaxis.label),
                xytext=(-40, -10), textcoords="offset points", va="top", ha="left", fontsize=7.5, color="0.25")
    return fig


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


def caption(data: pd.DataFrame, points: pd.DataFrame, speed: bool) -> str:
    """What the perplexity is and was measured on, what the x axis means, markers and emulator timings."""
    text = (f"Perplexity: token-level (lm-eval weighted_perplexity), the QDQ program where the run has one, else the "
            f"deployed program, else FP; {_eval_setting(data)}.{_subset_text(data)}")
    text += (" Speed: decode tokens/s, per speed source: `estimate <SoC>` is a phone's speed estimated from the "
             "compiled program, `what-if <SoC>` from the run's config (docs/htp-speed.md), `measured <target>` was "
             "timed there; each has its own front."
             if speed else
             " Size: the .pte where deployed, else the weights at their quantized widths.")
    text += " Filled markers (joined by a line): the Pareto front of their target; hollow: dominated."
    if points["collapsed"].any():
        text += (f" ▲ on the top edge: collapsed (perplexity > {COLLAPSE_FACTOR:g}x the median of the plotted "
                 "points), value written out, left out of the y axis and the fronts.")
    if speed and set(points["target"]) & EMULATED:  # x86_emulator: HTP runs from before the estimate
        text += " x86_emulator timings are emulator timings on this host, not phone speed."
    return text


def size_figure(data: pd.DataFrame):
    """Perplexity vs size (smaller is better on both), or None when no row has both."""
    points, shared = _points(data, "size_mb")
    if points.empty:
        return None
    return _figure(points, shared, False, "size (MB)", "Perplexity vs size", caption(data, points, speed=False))


def speed_figure(data: pd.DataFrame):
    """Perplexity vs decode speed (faster and lower is better), or None when no row measured decode speed."""
    points, shared = _points(data, "decode_tok_s", group="speed_source")
    if points.empty:
        return None
    sources = set(points["target"])
    estimated = all(str(t).startswith(("estimate", "what-if")) for t in sources)
    axis = "decode speed (tokens/s), estimated for a phone" if estimated \
        else "decode speed (tokens/s), by source: see the fronts"
    return _figure(points, shared, True, axis, "Perplexity vs decode speed",
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
