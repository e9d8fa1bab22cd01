"""The sensitivity heatmap: decoder layers x projections, one panel per view, colour = the loss a group carries in that
view (the cost view's delta perplexity, the gain view's with its sign flipped: red is sensitive in both)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

PROJECTION_ORDER = ["q", "k", "v", "o", "gate", "up", "down"]


def heatmap(table: pd.DataFrame, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import SymLogNorm

    views = [v for v in ("cost", "gain") if v in table]
    layers = table.dropna(subset=["layer"])
    n_layers = int(layers["layer"].max()) + 1 if len(layers) else 0
    fig, axes = plt.subplots(1, len(views), figsize=(4.2 * len(views) + 1, 0.25 * n_layers + 2.2), squeeze=False)
    sign = {"cost": 1.0, "gain": -1.0}
    for ax, view in zip(axes[0], views):
        grid = np.full((n_layers, len(PROJECTION_ORDER)), np.nan)
        for row in layers.itertuples():
            grid[int(row.layer), PROJECTION_ORDER.index(row.projection)] = sign[view] * 100 * getattr(row, view)
        limit = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
        image = ax.imshow(grid, aspect="auto", cmap="RdBu_r", norm=SymLogNorm(0.05, vmin=-limit, vmax=limit))
        ax.set_xticks(range(len(PROJECTION_ORDER)), PROJECTION_ORDER)
        ax.set_yticks(range(n_layers), [str(i) for i in range(n_layers)], fontsize=7)
        ax.set_xlabel("projection")
        ax.set_ylabel("decoder layer")
        label = ("cost: the group alone at low precision, the rest high" if view == "cost"
                 else "gain, sign flipped: the group alone at high precision, the rest low")
        others = table[table["layer"].isna()]
        extra = "; ".join(f"{r.group} {sign[view] * 100 * getattr(r, view):+.2f}%" for r in others.itertuples())
        ax.set_title(f"{label}\n{extra}", fontsize=8)
        fig.colorbar(image, ax=ax, label="loss carried: delta perplexity (%)" if view == "cost"
                     else "loss removed by promoting: -delta perplexity (%)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
