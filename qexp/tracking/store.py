"""Track stage: one MLflow run per experiment.

The store defaults to an embedded one in the repo (sqlite:///<repo>/mlruns.db, artifacts in <repo>/mlartifacts),
follows $MLFLOW_TRACKING_URI or tracking.uri for a server, and is checked for reachability before any work
starts. A run that raises ends FAILED with the error as an artifact (error.txt) and tag.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any, Dict, Optional

import mlflow

from qexp.core.config import TrackingConfig
from qexp.core.errors import TrackingError
from qexp.core.metrics import check as check_metrics
from qexp.core.provenance import REPO_ROOT
from qexp.tracking.address import embedded_store_uri, resolve_uri, sqlite_initialised_once
from qexp.tracking.naming import (
    EXPERIMENT_DESCRIPTION,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    NOTE_TAG,
    failed_description,
)
from qexp.tracking.logins import raise_if_refused
from qexp.core.redact import redact_text
from qexp.tracking.ui_view import VIEW_TAG, view_json

log = logging.getLogger("qexp")

DIGEST_CHARS = 16  # of a dataset's sha256 in MLflow (its column holds 36 characters)


_RECONCILED: set = set()  # (store, experiment) pairs this process has reconciled


def reconcile_once(uri: str, experiment_id: str) -> None:
    """Mark this host's dead RUNNING runs of the experiment KILLED, once per process (see liveness.py)."""
    from qexp.core.liveness import reconcile

    if (uri, experiment_id) not in _RECONCILED:
        _RECONCILED.add((uri, experiment_id))
        reconcile(mlflow.tracking.MlflowClient(uri), experiment_id)


def watch_experiment(uri: str, experiment_id: str) -> None:
    """Reconcile dead runs now, and have a watchdog end this process's runs KILLED if it dies uncaught."""
    from qexp.tracking.watchdog import watch

    reconcile_once(uri, experiment_id)
    watch(uri, experiment_id)


_EXPERIMENT_TAGS = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, NOTE_TAG: EXPERIMENT_DESCRIPTION, VIEW_TAG: view_json()}


def describe_experiment(experiment: "mlflow.entities.Experiment", client=None) -> None:
    """Give an experiment qexp's kind, view and description (experiments created before them, or classified by
    MLflow, included); a description the user wrote is kept."""
    client = client or mlflow.tracking.MlflowClient()
    wanted = dict(_EXPERIMENT_TAGS)
    if experiment.tags.get(NOTE_TAG):
        del wanted[NOTE_TAG]
    for key, value in wanted.items():
        if experiment.tags.get(key) != value:
            client.set_experiment_tag(experiment.experiment_id, key, value)


def _caught(exc: BaseException) -> None:
    """SLURM's end of the job is being handled: its signal handler stops raising it again."""
    from qexp.tracking.slurm import JobTerminated

    if isinstance(exc, JobTerminated):
        exc.caught()


class Tracker:
    """One run in the store. Its writes go through a RunWriter (writer.py): tried again while the store is away,
    spooled past tracking.outage_s. `patient`: a sweep's job, whose store the sweep reached already, waits that long
    for it at the start too; a run on its own says at once that its store does not answer (a typo, most often)."""

    def __init__(self, cfg: TrackingConfig, patient: bool = False):
        self.cfg = cfg
        self.uri = resolve_uri(cfg)
        self.patient = patient
        self.run_id: Optional[str] = None

    # ---- setup
    def connect(self) -> str:
        """Point MLflow at the store, check it answers, return the experiment id."""
        mlflow.set_tracking_uri(self.uri)
        if redact_text(self.uri) != self.uri:  # MLflow prints "View run at <uri>" on stdout, credentials included
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        if self.uri.startswith(("http://", "https://")):
            self._check_server()
        try:
            with sqlite_initialised_once(self.uri):
                experiment_id = self._experiment_id()
        except Exception as exc:  # noqa: BLE001 - any store failure is the user's store, reported in one line
            raise_if_refused(self.uri, exc, f"read experiment {self.cfg.experiment!r}")
            raise TrackingError(
                f"MLflow store {redact_text(self.uri)} is not usable: {type(exc).__name__}: "
                f"{redact_text(str(exc).splitlines()[0][:200])}",
                "check tracking.uri / MLFLOW_TRACKING_URI",
            ) from exc
        watch_experiment(self.uri, experiment_id)
        return experiment_id

    def _experiment_id(self) -> str:
        experiment = mlflow.get_experiment_by_name(self.cfg.experiment)
        if experiment is not None:
            describe_experiment(experiment)
            return experiment.experiment_id
        artifact_location = None
        if self.uri == embedded_store_uri():
            (REPO_ROOT / "mlartifacts").mkdir(mode=0o700, exist_ok=True)
            artifact_location = (REPO_ROOT / "mlartifacts").as_uri()
        try:
            return mlflow.create_experiment(self.cfg.experiment, artifact_location=artifact_location,
                                            tags=_EXPERIMENT_TAGS)
        except mlflow.exceptions.MlflowException as exc:  # created by a process that started at the same moment
            experiment = mlflow.get_experiment_by_name(self.cfg.experiment)
            if experiment is None:
                raise
            log.debug("experiment %s was created concurrently (%s)", self.cfg.experiment, exc)
            return experiment.experiment_id

    def _check_server(self) -> None:
        import requests

        from qexp.tracking.writer import patiently

        def healthy() -> None:
            requests.get(self.uri.rstrip("/") + "/health", timeout=self.cfg.connect_timeout_s).raise_for_status()

        try:
            patiently(self.uri, self.cfg.outage_s if self.patient else 0, healthy, who="this sweep job")
        except Exception as exc:  # noqa: BLE001
            raise TrackingError(
                f"MLflow tracking server {redact_text(self.uri)} is unreachable ({type(exc).__name__})",
                "start it (mlflow server --host 127.0.0.1 --port 5000) or unset tracking.uri / "
                "MLFLOW_TRACKING_URI to use the embedded store",
            ) from exc
        # MLflow's own retries stay short (a wrong address is one line within seconds); a run's writes ride out an
        # outage of tracking.outage_s themselves (writer.py)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

    def finished_run(self, config_hash: str) -> Optional[mlflow.entities.Run]:
        """The latest FINISHED run of this config in the experiment (to skip it on a sweep's resume)."""
        experiment_id = self.connect()
        runs = mlflow.tracking.MlflowClient(self.uri).search_runs(
            [experiment_id], filter_string=f"tags.config_hash = '{config_hash}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"], max_results=1,
        )
        return runs[0] if runs else None

    # ---- run lifecycle
    def start(self, run_name: Optional[str], tags: Dict[str, str]) -> str:
        from mlflow.tracking.context.registry import resolve_tags

        from qexp.core.liveness import owner_tags
        from qexp.tracking.writer import RunWriter

        global _WRITER
        experiment_id = self.connect()
        try:
            run = mlflow.tracking.MlflowClient(self.uri).create_run(
                experiment_id, run_name=run_name, tags=resolve_tags({**tags, **owner_tags()}))
        except Exception as exc:  # noqa: BLE001 - a login the store refuses is one line; anything else as it was
            raise_if_refused(self.uri, exc, f"write a run to experiment {self.cfg.experiment!r}")
            raise
        self.run_id = run.info.run_id
        spool_root = Path(self.cfg.spool_dir) if self.cfg.spool_dir else REPO_ROOT / "spool"
        _WRITER = RunWriter(self.uri, self.run_id, self.cfg.outage_s, spool_root)
        log.info("MLflow run %s in %s (experiment %s)", self.run_id, redact_text(self.uri), self.cfg.experiment)
        return self.run_id

    def finish(self, status: str = "FINISHED") -> None:
        """End the run; a run whose record went to a spool raises, after it, the one line that says where."""
        global _WRITER
        if self.run_id is None:
            return
        writer = _writer()
        try:
            writer.write("end", {"status": status, "end_time": int(time.time() * 1000)})
        finally:
            _WRITER, self.run_id = None, None
        if writer.spool is not None and status == "FINISHED":
            raise TrackingError(f"the store at {redact_text(self.uri)} went away during run {writer.run_id}: its "
                                f"record is spooled in {writer.spool.folder}",
                                f"python -m qexp.store replay {writer.spool.folder} once the store answers")

    def end(self, run_log: str, exc: Optional[BaseException] = None) -> None:
        """Attach the run's log as run.log, then end the run FINISHED; with `exc`, FAILED (even if the log could not
        be written). A log that cannot be written on success raises, so the caller ends the run FAILED."""
        if self.run_id is None:  # ended already (its end raised that its record is spooled)
            return
        if exc is None:
            Tracker.text(run_log, "run.log")
            self.finish()
            return
        _caught(exc)
        try:
            Tracker.text(run_log, "run.log")
        finally:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """End the active run FAILED, with the error as a tag and the full traceback as an artifact."""
        if self.run_id is None:
            return
        from qexp.core.liveness import KILLED_TAG
        from qexp.tracking.slurm import JobTerminated, slurm_reason

        if isinstance(exc, JobTerminated):  # SLURM ended the job: KILLED, with what SLURM says of it
            reason = redact_text(slurm_reason(exc))
            try:
                Tracker.tags({KILLED_TAG: reason[:5000], "error": f"KILLED: {reason}"[:5000],
                              NOTE_TAG: f"KILLED: {reason}"[:5000]})
            finally:
                self.finish("KILLED")
            return
        message = redact_text(f"{type(exc).__name__}: {exc}")
        try:
            Tracker.tags({"error": message[:5000], NOTE_TAG: redact_text(failed_description(exc))})
            Tracker.text("".join(traceback.format_exception(exc)), "error.txt")
        finally:
            self.finish("FAILED")

    # ---- logging (thin, so stages do not import mlflow; every string goes through redact_text)
    @staticmethod
    def params(values: Dict[str, Any]) -> None:
        _writer().write("params", {"params": {k: redact_text(str(v)) for k, v in values.items()}})

    @staticmethod
    def tags(values: Dict[str, Any]) -> None:
        _writer().write("tags", {"tags": {k: redact_text(str(v)) for k, v in values.items()}})

    @staticmethod
    def describe(description: str) -> None:
        """The run's description in the MLflow UI (its one-line result)."""
        Tracker.tags({NOTE_TAG: description})

    @staticmethod
    def dataset(features, name: str, digest: str, source: str, context: str, tags: Dict[str, str]) -> None:
        """A dataset as an MLflow input (the UI's Dataset column, `dataset.name`/`dataset.context` in searches).

        `features` are the token ids; MLflow keeps their schema and shape, not the data (eval/windows.npy does)."""
        _writer().write("dataset", {"features": features, "name": name, "digest": digest[:DIGEST_CHARS],
                                    "source": source, "context": context,
                                    "tags": {k: redact_text(str(v)) for k, v in tags.items()}})

    @staticmethod
    def metrics(values: Dict[str, float]) -> None:
        check_metrics(values)
        now = int(time.time() * 1000)  # taken once: a write tried again sends the same points
        _writer().write("metrics", {"metrics": [[k, float(v), now, 0] for k, v in values.items() if v is not None]})

    @staticmethod
    def metric_history(curves: Dict[str, list]) -> None:
        """Metrics with steps ({name: [(step, value), ...]}, e.g. QAT's loss curves): the UI plots them by step."""
        check_metrics(curves)
        now = int(time.time() * 1000)
        _writer().write("metrics", {"metrics": [[name, float(value), now, int(step)] for name, points in curves.items()
                                                for step, value in points]})

    @staticmethod
    def text(content: str, path: str) -> None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / Path(path).name
            local.write_text(redact_text(content))
            Tracker.file(local, str(Path(path).parent) if Path(path).parent != Path(".") else None)

    @staticmethod
    def file(local_path: str | Path, artifact_dir: Optional[str] = None) -> None:
        _writer().write("artifact", {"local": str(local_path), "artifact_dir": artifact_dir})


_WRITER = None  # the RunWriter of the run this process is in (one at a time, as MLflow's active run was)


def _writer():
    if _WRITER is None:
        raise RuntimeError("no qexp run is active: Tracker.start() first")
    return _WRITER
