"""The search's plot: every finished trial's selection perplexity against its bits, the seeds marked, the Pareto
front drawn with its 95% intervals."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def front_plot(trials: pd.DataFrame, front: pd.DataFrame, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    others = trials[~trials["seed"]]
    seeds = trials[trials["seed"]]
    ax.scatter(others["bits"], 100 * others["ppl_vs_fp_selection"], s=12, color="0.65", label="trial")
    ax.scatter(seeds["bits"], 100 * seeds["ppl_vs_fp_selection"], s=40, marker="^", facecolors="none",
               edgecolors="tab:blue", label="seed (uniform; greedy recipes)")
    y = 100 * front["ppl_vs_fp_selection"]
    err = [y - 100 * front["ppl_vs_fp_selection_ci_low"], 100 * front["ppl_vs_fp_selection_ci_high"] - y]
    ax.errorbar(front["bits"], y, yerr=err, fmt="o-", color="tab:red", ms=4, capsize=2, lw=1,
                label="Pareto front (95% paired interval)")
    for i, row in enumerate(front.itertuples()):  # above and below in turn: neighbours on the front are close
        ax.annotate(f"{row.bits:.2f}", (row.bits, 100 * row.ppl_vs_fp_selection), textcoords="offset points",
                    xytext=(4, 5 if i % 2 == 0 else -11), fontsize=7, color="tab:red")
    ax.set_xlabel("average bits per decoder-linear weight (lm head apart)")
    ax.set_ylabel("perplexity vs FP on the selection windows (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
