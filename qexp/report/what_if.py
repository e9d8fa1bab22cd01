"""`--speed-estimate SOC`: every run of a report with the phone speed its configuration would have on SOC
(qexp/speed), so QDQ-only runs (backend=none) get a speed axis too.

A run compiled for HTP on that SoC keeps the estimate it logged from its compiled program (QNN's byte counts); any
other run gets the estimate from its resolved config (its config.yaml artifact: the model's shapes from its
metadata, the quant config, the context; an HTP run's own prefill length and prompt, else the HTP defaults),
labelled `what-if`. Runs whose model shapes cannot be read (a folder that moved) are left without one, and the notes
say how many."""

from __future__ import annotations

from typing import Optional

import pandas as pd

from qexp.report.base import Report

WHAT_IF = "what-if"


def _config(run_id: str):
    import os

    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file per run: no bar each
    return OmegaConf.load(MlflowClient().download_artifacts(run_id, "config.yaml"))


def _what_if(cfg, soc: str) -> Optional[dict]:
    from omegaconf import OmegaConf

    from qexp.backends.htp.config import HtpConfig
    from qexp.core.config import NO_QUANT, QDQ_ONLY_SCHEMES, ModelConfig, QuantConfig
    from qexp.speed import estimate_config, model_shapes

    quant = OmegaConf.merge(OmegaConf.structured(QuantConfig), cfg.quant)
    if quant.scheme == NO_QUANT or quant.scheme in QDQ_ONLY_SCHEMES:
        return None  # HTP runs neither
    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model)
    defaults = HtpConfig()
    backend = cfg.backend if cfg.backend.get("name") == "htp" else {}
    mode = str(backend.get("model_mode", defaults.model_mode.value)).split(".")[-1]
    prefill_ar = None if mode == "kv" else int(backend.get("prefill_ar_len", defaults.prefill_ar_len))
    prompt = int(backend.get("bench", {}).get("prompt_len", defaults.bench.prompt_len))
    context = int(cfg.export.max_context_len)
    estimate, _ = estimate_config(model_shapes(model), quant, soc, context, prefill_ar, prompt)
    return {**{f"metrics.{k}": v for k, v in estimate.metrics().items()},
            "tags.speed_source": f"{WHAT_IF}:{estimate.source}", "tags.speed_soc": soc}


def add_speed_estimates(runs: pd.DataFrame, soc: str, report_notes: Optional[list] = None) -> pd.DataFrame:
    """`runs` with each run's speed estimate on `soc` (see the module docstring)."""
    from qexp.speed import check_soc

    check_soc(soc)  # a SoC without figures: one clear error before any download
    runs = runs.copy()
    missing = 0
    for i in runs.index:
        own = runs.at[i, "tags.speed_soc"] if "tags.speed_soc" in runs else None
        if own == soc and pd.notna(runs.get("metrics.decode_tok_s_est", pd.Series(dtype=float)).get(i)):
            continue  # compiled for this SoC: its own estimate, from QNN's counts
        try:
            values = _what_if(_config(runs.at[i, "run_id"]), soc)
        except Exception:  # noqa: BLE001 - no config.yaml, unreadable shapes: this run has no estimate, counted below
            values = None
        if values is None:
            missing += 1
            for column in [c for c in runs if c.endswith(("_est", "_est_err", "_est_low", "_est_high"))]:
                runs.at[i, column] = float("nan")
            continue
        for column, value in values.items():
            if column not in runs:
                runs[column] = pd.Series([None] * len(runs), index=runs.index, dtype=object if column.startswith(
                    "tags.") else float)
            runs.at[i, column] = value
    runs.attrs["speed_estimate"] = {"soc": soc, "missing": missing}
    return runs


def speed_estimate_note(runs: pd.DataFrame) -> Optional[str]:
    info = runs.attrs.get("speed_estimate")
    if not info:
        return None
    note = (f"--speed-estimate {info['soc']}: speed `{WHAT_IF} {info['soc']}` is estimated from each run's config "
            f"(shapes and scheme; docs/htp-speed.md), `estimate {info['soc']}` from a program compiled for it.")
    if info["missing"]:
        note += f" {info['missing']} run(s) have none (not an HTP scheme, or their config or shapes cannot be read)."
    return note


def annotate(report: Report, runs: pd.DataFrame) -> None:
    note = speed_estimate_note(runs)
    if note:
        report.notes.append(note)
