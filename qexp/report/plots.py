"""The report's plots: perplexity vs size, perplexity vs decode speed with one Pareto front per target."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import numpy as np
import pandas as pd

from qexp.report.base import Report
from qexp.report.table import EMULATED

PLOTS = ("ppl_vs_size", "ppl_vs_speed")


def pareto_front(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of points not dominated when larger x and smaller y are better, ordered by x."""
    order = np.argsort(-x)
    front, best = [], np.inf
    for i in order:
        if y[i] < best:
            front.append(i)
            best = y[i]
    return np.array(front[::-1], dtype=int)


def _quantized_ppl(data: pd.DataFrame) -> pd.Series:
    """The quantized model's perplexity on the full windows: QDQ, else the deployed program's, else FP (fp32 rows).

    QDQ first: a deployed phase may score only a subset of the windows (ppl_deployed_vs_qdq says how far it is)."""
    ppl = pd.Series(np.nan, index=data.index)
    for name in ("ppl_qdq", "ppl_deployed", "ppl_fp"):
        if name in data:
            ppl = ppl.fillna(data[name])
    return ppl


def _labels(data: pd.DataFrame) -> pd.Series:
    labels = data.get("scheme", data.index.astype(str)).astype(str)
    if "observer" in data:
        labels = labels + np.where(data["observer"].astype(str) == "-", "", "/" + data["observer"].astype(str))
    return labels


def _save(fig, out_prefix: Path, kind: str) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = out_prefix.with_name(f"{out_prefix.name}_{kind}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_size(data: pd.DataFrame, ppl: pd.Series, labels: pd.Series, out_prefix: Path) -> Optional[Path]:
    import matplotlib.pyplot as plt

    size = data["size_mb"]
    if not (ppl.notna().any() and size.notna().any()):
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(size, ppl)
    for x, y, label in zip(size, ppl, labels):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_yscale("log")  # a collapsed scheme (e.g. 8a8w on SmolLM2) would flatten the others
    ax.set_xlabel("MB: the .pte where deployed, else weights at their quantized widths")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title("Perplexity vs size")
    ax.grid(alpha=0.3)
    return _save(fig, out_prefix, PLOTS[0])


def _plot_speed(data: pd.DataFrame, ppl: pd.Series, labels: pd.Series, out_prefix: Path) -> Path:
    import matplotlib.pyplot as plt

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
    ax.set_xlabel("decode tok/s (log scale)")
    ax.set_ylabel("perplexity (QDQ, else deployed .pte)")
    title = "Perplexity vs decode speed"
    if set(targets) & EMULATED:
        title += "\n(x86 HTP emulator timings, not phone speed)"
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, out_prefix, PLOTS[1])


def plot(report: Report, out_prefix: Path) -> List[Path]:
    """<out_prefix>_ppl_vs_size.png and, when any run measured decode speed, <out_prefix>_ppl_vs_speed.png."""
    import matplotlib

    matplotlib.use("Agg")

    data = report.data
    ppl, labels = _quantized_ppl(data), _labels(data)
    written = [p for p in [_plot_size(data, ppl, labels, out_prefix)] if p is not None]
    if "decode_tok_s" in data and data["decode_tok_s"].notna().any():
        written.append(_plot_speed(data, ppl, labels, out_prefix))
    else:
        report.notes.append("No perplexity-vs-speed plot: no run in the table measured decode speed.")
    return written
