"""One report plot drawn legibly (qexp/report/plots.py says how, and turns the report's data into points): axis scales,
each target's Pareto front, one marker and legend entry per spot, collapsed points on the top edge with their values,
the legend beside the axes and the caption under them.
"""

from __future__ import annotations

import textwrap
from typing import List, Tuple

import numpy as np
import pandas as pd

LOG_SPAN = 20.0  # an axis goes log only when its points span more than this factor
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
MARKERS = ("o", "s", "D", "v", "P", "X", "*", "h", "p")  # no "^": it marks collapsed points; 9 vs 10 colours: 90 pairs
FRONT_STYLES = ("--", ":", "-.", (0, (6, 2, 1, 2)))
SAME_SPOT_PT = 5  # markers ~8 pt across: centres closer than this hide each other
DODGE_PT = 7  # so such points are drawn this far apart, side by side
NOTE_ROW_PT = 12  # one collapsed point's note per row, this far apart (8 pt text)


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
    """One marker and legend entry per point. Points whose markers would overlap (same size, close perplexity) are
    drawn side by side, DODGE_PT apart around their common spot, so each stays visible and named; collapsed ones sit
    on the top edge with their value written under it."""
    from matplotlib.transforms import offset_copy

    notes, n = 0, 0
    for group in _same_spot(ax, points):
        for k, index in enumerate(group):
            row, colour, marker = points.loc[index], COLOURS[n % len(COLOURS)], MARKERS[n % len(MARKERS)]
            n += 1
            label = f"{row['label']} (ppl {row['y']:.4g})"
            filled = index in members
            dodge = (k - (len(group) - 1) / 2) * DODGE_PT
            style = dict(s=60, linewidths=1.5, edgecolors=colour, zorder=3,
                         facecolors=(*_rgb(colour), 0.45) if filled else "none")
            if not row["collapsed"]:
                shifted = offset_copy(ax.transData, fig=ax.figure, x=dodge, units="points")
                ax.scatter([row["x"]], [row["y"]], marker=marker, label=label, transform=shifted, **style)
                continue
            shifted = offset_copy(ax.get_xaxis_transform(), fig=ax.figure, x=dodge, units="points")
            ax.scatter([row["x"]], [1.0], marker="^", transform=shifted, clip_on=False, label=label + ", off scale",
                       **style)
            notes += 1
            right_half = ax.transAxes.inverted().transform(ax.transData.transform((row["x"], 1.0)))[0] > 0.6
            ax.annotate("▲ " + label, xy=(row["x"], 1.0), xycoords=("data", "axes fraction"),
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


def _draw_bands(ax, points: pd.DataFrame) -> None:
    """Each estimated point's interval on x (the speed model's 10-90% band of held-out errors): two configurations
    whose bars overlap are not told apart by the estimate."""
    if "x_low" not in points:
        return
    shown = points[~points["collapsed"] & points["x_low"].notna() & points["x_high"].notna()]
    if len(shown):
        ax.errorbar(shown["x"], shown["y"], xerr=[shown["x"] - shown["x_low"], shown["x_high"] - shown["x"]],
                    fmt="none", ecolor="0.6", elinewidth=0.9, capsize=2.5, zorder=1,
                    label="estimate's 10-90% band")


def draw_figure(points: pd.DataFrame, shared: str, larger_x_better: bool, xlabel: str, title: str, caption: str):
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
    _draw_bands(ax, points)
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
