"""Finding the two runs of `--compare` in the MLflow store (qexp/report/compare_runs.py compares them): a run by id,
unique id prefix or exact name, and each run's summary (status, and why its numbers may be incomplete). Reads the
store only: a dead RUNNING run is reported, not reconciled.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from qexp.report.base import ReportError
from qexp.report.query import default_tracking_uri
from qexp.tracking.address import sqlite_file

MIN_PREFIX = 6  # hex characters of a run id: 16.7 million values, ambiguous only in huge stores (then: an error)


@dataclass
class RunSummary:
    run_id: str
    name: str
    status: str
    started: str
    experiment: str
    warning: Optional[str] = None  # why this run's numbers may be incomplete (not FINISHED, deleted)


def tracking_client(tracking_uri: Optional[str]):
    import mlflow

    uri = tracking_uri or default_tracking_uri()
    local = sqlite_file(uri)
    if local is not None and not os.path.exists(local):  # MLflow would create an empty store and find nothing
        raise ReportError(f"no MLflow store at {local}", "pass --tracking-uri (or set MLFLOW_TRACKING_URI)")
    mlflow.set_tracking_uri(uri)  # paired.per_window reads artifacts through the global URI, as the report does
    return mlflow.tracking.MlflowClient(uri)


def _experiment_ids(client, experiment: Optional[str]) -> List[str]:
    """Where run names are looked up: the --experiment the user named, else every experiment."""
    if experiment is None:
        return [e.experiment_id for e in client.search_experiments()]
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ReportError(f"no MLflow experiment {experiment!r} in {client.tracking_uri}",
                          "check --experiment (see `make ui`) or --tracking-uri")
    return [found.experiment_id]


def _quoted(value: str) -> str:
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ReportError(f"run name {value!r} holds both quote characters", "pass its run id instead")


def _candidates(client, ref: str, name_experiments: List[str]) -> Dict[str, object]:
    """Runs whose id starts with `ref` (>= MIN_PREFIX hex characters) or whose name is exactly `ref`."""
    from mlflow.entities import ViewType

    found: Dict[str, object] = {}
    if len(ref) >= MIN_PREFIX and re.fullmatch(r"[0-9a-f]+", ref):
        every = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
        for run in client.search_runs(every, f"attributes.run_id LIKE '{ref}%'", ViewType.ALL, max_results=10):
            found[run.info.run_id] = run
    if name_experiments:
        for run in client.search_runs(name_experiments, f"attributes.run_name = {_quoted(ref)}", max_results=10):
            found[run.info.run_id] = run
    return found


def resolve_run(client, ref: str, experiment: Optional[str] = None):
    """A run by id, unique id prefix, or exact name (within `experiment` if given); ReportError otherwise."""
    from mlflow.exceptions import MlflowException

    name_experiments = _experiment_ids(client, experiment)  # a misspelt --experiment is an error, whatever the refs
    try:
        return client.get_run(ref)
    except MlflowException:
        pass  # not a whole run id: try it as a prefix or a name
    found = _candidates(client, ref, name_experiments)
    if len(found) == 1:
        return next(iter(found.values()))
    where = f"experiment {experiment!r}" if experiment else "any experiment"
    if not found:
        raise ReportError(f"no run {ref!r}: not a run id, a run-id prefix (>= {MIN_PREFIX} characters) or a run "
                          f"name in {where}", "copy the id from the MLflow UI (`make ui`)")
    listed = ", ".join(f"{run.info.run_id[:8]} ({run.info.run_name}, {_started(run)})" for run in found.values())
    raise ReportError(f"{ref!r} is ambiguous, it matches runs {listed}", "pass one of the ids")


def _started(run) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.info.start_time / 1000))


def run_summary(client, run) -> RunSummary:
    from qexp.core.liveness import KILLED_TAG, death_reason

    info, tags = run.info, run.data.tags
    warning = None
    if info.status == "RUNNING":
        dead = death_reason(tags)
        warning = "RUNNING: " + (f"its process is dead ({dead})" if dead else "still running") + \
            ", its metrics may be incomplete"
    elif info.status != "FINISHED":
        why = tags.get("error") or tags.get(KILLED_TAG) or "no reason recorded"
        warning = f"{info.status}: {why[:100]}; its metrics are incomplete"
    if info.lifecycle_stage == "deleted":
        warning = "DELETED run" + (f"; {warning}" if warning else "")
    return RunSummary(info.run_id, info.run_name or "-", info.status, _started(run),
                      client.get_experiment(info.experiment_id).name, warning)
