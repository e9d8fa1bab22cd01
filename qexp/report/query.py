"""MLflow runs for the report: FINISHED runs, latest per config hash, under today's metric/param/tag names."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import pandas as pd

from qexp.report.base import ReportError, column
from qexp.tracking.sweep import ROLE_TAG, SWEEP_TAG

# Today's column <- the column runs logged it under before the names became backend-agnostic. An existing store
# keeps those runs; load_runs fills each column from its legacy one where a run has no value under today's name.
LEGACY_NAMES: Dict[str, str] = {
    "metrics.ppl_deployed": "metrics.ppl_htp",
    "metrics.word_ppl_deployed": "metrics.word_ppl_htp",
    "metrics.byte_ppl_deployed": "metrics.byte_ppl_htp",
    "metrics.bits_per_byte_deployed": "metrics.bits_per_byte_htp",
    "metrics.ppl_deployed_vs_qdq": "metrics.ppl_htp_vs_qdq",
    "metrics.top1_agreement_deployed_vs_qdq": "metrics.top1_agreement_htp_vs_qdq",
    "metrics.deployed_eval_tokens": "metrics.htp_eval_tokens",
    "metrics.deployed_eval_windows": "metrics.htp_eval_windows",
    "metrics.logits_sqnr_db_qdq_vs_fp": "metrics.logits_sqnr_db_qdq",
    "metrics.logits_sqnr_db_deployed_vs_fp": "metrics.logits_sqnr_db_deployed",
    "params.backend.name": "params.backend.kind",
    # Not params.kv.name: the old config logged its kv group on every run, whatever the backend; the old deployed
    # phase tagged the KV updater it actually ran (same values: smart_mask / shift_pointer).
    "params.backend.kv_update": "tags.kv_update",
    "params.backend.soc": "tags.htp_soc",
    "tags.deployed_eval_path": "tags.htp_eval_path",
}
# Old runs (the ones with params.backend.kind, which today's config no longer has) logged the whole backend group
# on every run, so their backend.soc is the default SoC even on runs that never compiled for one: there the legacy
# column replaces it.
LEGACY_WINS_ON_OLD_RUNS = ("params.backend.soc",)
OLD_RUN_MARKER = "params.backend.kind"


def with_current_names(runs: pd.DataFrame) -> pd.DataFrame:
    """runs with every LEGACY_NAMES column filled from its legacy column, and tags.scheme for runs without it."""
    runs = runs.copy()
    old_run = column(runs, OLD_RUN_MARKER).notna()
    for current_name, legacy_name in LEGACY_NAMES.items():
        if current_name not in runs and legacy_name not in runs:
            continue
        current = column(runs, current_name)
        if current_name in LEGACY_WINS_ON_OLD_RUNS:
            current = current.where(~old_run)
        runs[current_name] = current.where(current.notna(), column(runs, legacy_name))
    # every run from before the device setting ran its torch phases on the CPU
    runs["tags.device"] = column(runs, "tags.device").fillna("cpu")
    scheme = column(runs, "tags.scheme")
    if scheme.isna().any():
        # The only place the report names a backend: runs logged before the scheme tag quantized their XNNPACK
        # program with backend.qmode (their QNN quant group was fp32), every other run with quant.name.
        xnnpack = (column(runs, "params.backend.name") == "xnnpack").to_numpy()
        legacy = np.where(xnnpack, column(runs, "params.backend.qmode"), column(runs, "params.quant.name"))
        runs["tags.scheme"] = scheme.where(scheme.notna(), pd.Series(legacy, index=runs.index))
    return runs


def default_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI or the embedded store, as the runs resolve it."""
    from qexp.core.config import TrackingConfig
    from qexp.tracking.address import resolve_uri

    return resolve_uri(TrackingConfig())


def load_runs(experiment: str, sweep: Optional[str] = None, filter_string: str = "",
              tracking_uri: Optional[str] = None) -> pd.DataFrame:
    """FINISHED runs of an experiment (optionally one sweep's), newest first, one per config hash."""
    import mlflow

    from qexp.tracking.store import reconcile_once

    mlflow.set_tracking_uri(tracking_uri or default_tracking_uri())
    try:
        found = mlflow.get_experiment_by_name(experiment)
    except Exception as exc:  # noqa: BLE001 - a login the served store refuses is one line
        from qexp.tracking.logins import raise_if_refused

        raise_if_refused(mlflow.get_tracking_uri(), exc, f"read experiment {experiment!r}")
        raise
    if found is None:
        raise ReportError(f"no MLflow experiment {experiment!r} in {mlflow.get_tracking_uri()}",
                          "pass --experiment (see `make ui`) or --tracking-uri")
    reconcile_once(mlflow.get_tracking_uri(), found.experiment_id)  # dead RUNNING runs become KILLED first
    clauses = ([filter_string] if filter_string else []) + ([f"tags.`{SWEEP_TAG}` = '{sweep}'"] if sweep else [])
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string=" and ".join(
        ["attributes.status = 'FINISHED'"] + clauses), order_by=["attributes.start_time DESC"], output_format="pandas")
    unfinished = mlflow.search_runs(experiment_names=[experiment], filter_string=" and ".join(
        ["attributes.status != 'FINISHED'"] + clauses), output_format="pandas")
    if not unfinished.empty and f"tags.{ROLE_TAG}" in unfinished:
        unfinished = unfinished[unfinished[f"tags.{ROLE_TAG}"] != "sweep"]
    if runs.empty:
        raise ReportError(f"no FINISHED runs in experiment {experiment!r}" + (f" for sweep {sweep!r}" if sweep else "")
                          + (f" matching {filter_string!r}" if filter_string else ""), "check the names (`make ui`)")
    if f"tags.{ROLE_TAG}" in runs:
        runs = runs[runs[f"tags.{ROLE_TAG}"] != "sweep"]
    runs = with_current_names(runs.drop_duplicates("tags.config_hash", keep="first").reset_index(drop=True))
    # What the table leaves out, so the report can say so: runs that never finished (FAILED, KILLED, RUNNING).
    runs.attrs["left_out"] = unfinished["status"].value_counts().to_dict() if not unfinished.empty else {}
    return runs
