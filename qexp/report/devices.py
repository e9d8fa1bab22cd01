"""The seeds' layout: one row per (configuration, device) instead of one per run.

A run with a QDQ phase gives a "CPU (QDQ)" row (perplexity on all windows, and on the deployed phase's subset when it
has one); its deployed phase gives a row for its device (HTP on the x86 emulator, XNNPACK on the CPU), scored on its
subset only; each model's FP reference gives an "FP32" row. "config" says what was quantized how: the weight grid,
the lm head's, and the algorithms (RTN when none).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qexp.core.config import NO_QUANT
from qexp.report.base import column

DEVICE_OF_TARGET = {"x86_emulator": "HTP (x86 emulator)", "android": "HTP (phone)", "cpu": "XNNPACK (CPU)"}
HEADERS = ["model", "precision", "config", "device", "PPL (deployed subset)", "PPL (all windows)", "Δ vs FP",
           "deployable"]


def _config(runs: pd.DataFrame) -> pd.Series:
    def text(name):
        return [None if pd.isna(v) or v == "" else str(v) for v in column(runs, name)]

    # model transforms are tagged in the order applied; calibration-time ones (seq_mse) only appear in the params
    param_columns: dict = {}
    for c in runs.columns:
        if c.startswith("params.algorithm."):
            param_columns.setdefault(c.split(".")[2], []).append(c)
    from_params = [[a for a, cols in sorted(param_columns.items()) if row[cols].notna().any()]
                   for _, row in runs.iterrows()]
    tagged = text("tags.algorithm")
    ordered = []
    for tag, extra in zip(tagged, from_params):
        names = tag.split(",") if tag else []  # each maybe with its non-default settings: "gptq(damp=0.1)"
        bare = {name.split("(")[0] for name in names}
        ordered.append(",".join(names + [a for a in extra if a not in bare]) or None)
    configs = []
    for algorithm, weights, granularity, block, lm_head in zip(
            ordered, text("tags.weight_grid"), text("params.quant.weight_granularity"),
            text("params.quant.block_size"), text("tags.lm_head_grid")):
        if weights is None:  # runs from before the grid tags
            weights = f"block {block}" if granularity == "per_block" else (granularity or "?")
        configs.append(f"{algorithm or 'RTN'}, {weights}, lm head {lm_head or '?'}")
    return pd.Series(configs, index=runs.index)


def device_table(runs: pd.DataFrame) -> pd.DataFrame:
    num = lambda name: pd.to_numeric(column(runs, name), errors="coerce")  # noqa: E731
    model = column(runs, "params.model.name")
    scheme = column(runs, "tags.scheme").fillna(column(runs, "params.quant.scheme"))
    config = _config(runs)
    deployable = column(runs, "tags.deployable").fillna("-")
    # eval.htp_exact runs computed their QDQ phase with HTP's integer arithmetic: a different CPU row
    cpu = np.where(column(runs, "tags.qdq_arithmetic").fillna("fake_quant") == "htp_exact", "CPU (QDQ, HTP arithmetic)",
                   "CPU (QDQ)")
    rows = []
    for i in range(len(runs)):
        if scheme.iloc[i] == NO_QUANT or pd.isna(num("metrics.ppl_qdq").iloc[i]):
            continue
        rows.append([model.iloc[i], scheme.iloc[i], config.iloc[i], cpu[i], num("metrics.ppl_qdq_sub").iloc[i],
                     num("metrics.ppl_qdq").iloc[i], num("metrics.ppl_qdq_vs_fp").iloc[i], deployable.iloc[i]])
        if pd.notna(num("metrics.ppl_deployed").iloc[i]):
            target = column(runs, "tags.target").iloc[i]
            rows.append([model.iloc[i], scheme.iloc[i], config.iloc[i], DEVICE_OF_TARGET.get(target, str(target)),
                         num("metrics.ppl_deployed").iloc[i], np.nan, num("metrics.ppl_deployed_vs_fp").iloc[i],
                         deployable.iloc[i]])
    fp = pd.DataFrame({"model": model, "ppl": num("metrics.ppl_fp")}).dropna().drop_duplicates("model")
    for _, row in fp.iterrows():
        rows.append([row["model"], NO_QUANT, "-", "CPU (PyTorch)", np.nan, row["ppl"], 0.0, "-"])
    table = _merge_repeated_qdq_rows(pd.DataFrame(rows, columns=HEADERS))
    order = {NO_QUANT: 0}
    table["_fp"] = table["precision"].map(order).fillna(1)
    table = table.sort_values(["model", "_fp", "precision", "config", "device"], kind="stable").drop(columns="_fp")
    return table.reset_index(drop=True)


def _merge_repeated_qdq_rows(table: pd.DataFrame) -> pd.DataFrame:
    """A configuration run once QDQ-only and once with a deployed phase has the same QDQ phase twice (same config,
    same numbers): one CPU row, with the deployed subset's QDQ perplexity from the run that has one. Rows whose
    numbers differ stay apart."""
    key = ["model", "precision", "config", "device", "PPL (all windows)", "Δ vs FP", "deployable"]
    qdq = table["device"].str.startswith("CPU (QDQ") & table["PPL (all windows)"].notna()
    merged = (table[qdq].groupby(key, sort=False, dropna=False)["PPL (deployed subset)"]
              .agg(lambda values: values.dropna().iloc[0] if values.notna().any() else np.nan).reset_index())
    return pd.concat([merged[HEADERS], table[~qdq]], ignore_index=True)
