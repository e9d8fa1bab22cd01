"""The report's speed columns: each row's phone estimate where its run logged one, else what it measured on its
target (labelled), and headers that say which."""

from __future__ import annotations

import numpy as np
import pandas as pd

from qexp.report.base import column

EMULATED = {"x86_emulator"}
SPEEDS = ("ttft_ms", "decode_tok_s", "prefill_tok_s")


def speed_columns(runs: pd.DataFrame, num) -> None:
    """The speed columns and where each row's come from: an HTP run's phone estimate for its SoC (qexp/speed) where
    it logged one, else what the run measured on its target (the CPU for XNNPACK; the x86 emulator for an HTP run
    from before the estimate, labelled so)."""
    estimated = num("metrics.decode_tok_s_est").notna()
    soc = column(runs, "tags.speed_soc").fillna(column(runs, "params.backend.soc")).fillna("?").astype(str)
    kind = np.where(column(runs, "tags.speed_source").fillna("").astype(str).str.startswith("what-if"), "what-if ",
                    "estimate ")
    measured = num("metrics.decode_tok_s").notna() | num("metrics.ttft_ms").notna()
    emulated = runs["target"].isin(EMULATED)
    for name in SPEEDS:
        runs[name] = num(f"metrics.{name}_est").where(estimated, num(f"metrics.{name}"))
        runs[f"{name}_emulator"] = num(f"metrics.{name}").where(emulated)
    # estimates of two model versions (or fits to two data files) are not one axis: each row then names its version
    model = column(runs, "tags.speed_source").fillna("").astype(str).str.replace(r"^(what-if:)?estimate:", "",
                                                                                 regex=True)
    if model[estimated].nunique() > 1:
        soc = soc + " (" + model + ")"
    low, high = num("metrics.decode_tok_s_est_low"), num("metrics.decode_tok_s_est_high")
    runs["decode_tok_s_band"] = [f"[{a:.0f}, {b:.0f}]" if a == a and b == b else "-" for a, b in zip(low, high)]
    runs["decode_tok_s_low"], runs["decode_tok_s_high"] = low.where(estimated), high.where(estimated)  # plot's bars
    runs["speed_source"] = np.where(estimated, kind + soc, np.where(
        measured, np.where(emulated, "x86_emulator", "measured " + runs["target"].astype(str)), "-"))


def speed_headers(chosen: dict, data: pd.DataFrame) -> dict:
    """The speed columns' headers say what their figures are: "est." when every row's is a phone estimate, "est. or
    measured" (each row's in the speed column) when rows differ."""
    sources = data.get("speed_source", pd.Series(dtype=str)).astype(str)
    sources = sources[sources != "-"]
    if sources.empty:
        return chosen
    label = "est." if sources.str.startswith(("estimate", "what-if")).all() else "est. or measured: see speed"
    return {name: (source, f"{header} ({label})" if name in SPEEDS else header)
            for name, (source, header) in chosen.items()}
