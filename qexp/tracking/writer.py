"""A run's writes to its store, in one place, and what becomes of them when the store goes away mid-run.

Every write names its run (MlflowClient calls, not MLflow's per-thread "active run"), so that a write can be tried
again, or kept in a spool and replayed later, exactly as it was meant.

An error that says the store is away (no connection, a timeout, HTTP 5xx, 408 or 429: a server restart, a PostgreSQL
restart or failover) is tried again with backoff for up to `tracking.outage_s`. A store back within that loses
nothing: params and tags write the same values again, artifacts overwrite, metrics keep the timestamp of their first
try (MLflow keeps one copy of an identical point). Past it, the run goes on computing and keeps its record in a spool
(qexp/tracking/spool.py) that `python -m qexp.store replay` uploads once the store is back, and the run ends with one
line that says so: a store outage never costs the compute of a run. Any other error (a refused login, a value the
store rejects) raises at once, as before.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any, Callable, Dict

from qexp.core.redact import redact_text

log = logging.getLogger("qexp")

_AWAY_STATUS = re.compile(r"\b(?:error code|status(?: code)?:?|HTTP) ?\(?(5\d\d|408|429)\b")
_AWAY_WORDS = ("Max retries exceeded", "Connection refused", "ConnectionError", "RemoteDisconnected",
               "Read timed out", "timed out", "Connection aborted", "Connection reset")


def store_is_away(exc: BaseException) -> bool:
    """Whether an error from the store says it is unreachable or failing (worth waiting for), not that it refused
    what was asked (a login, a permission, a bad value)."""
    import requests

    if isinstance(exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError)):
        return True
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(exc, RestException):
        return exc.get_http_status_code() >= 500
    if isinstance(exc, MlflowException):
        text = str(exc)
        return any(word in text for word in _AWAY_WORDS) or bool(_AWAY_STATUS.search(text))
    return False


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


# ---- what each write sends: (client, run id, payload) -> None; the spool replays the same functions
def send_params(client, run_id: str, payload: Dict[str, Any]) -> None:
    from mlflow.entities import Param

    for batch in _batches([Param(k, v) for k, v in payload["params"].items()], 100):  # MLflow's limit per batch
        client.log_batch(run_id, params=batch)


def send_tags(client, run_id: str, payload: Dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    for batch in _batches([RunTag(k, v) for k, v in payload["tags"].items()], 100):
        client.log_batch(run_id, tags=batch)


def send_metrics(client, run_id: str, payload: Dict[str, Any]) -> None:
    from mlflow.entities import Metric

    metrics = [Metric(key, float(value), int(timestamp), int(step))
               for key, value, timestamp, step in payload["metrics"]]
    for batch in _batches(metrics, 1000):
        client.log_batch(run_id, metrics=batch)


def send_artifact(client, run_id: str, payload: Dict[str, Any]) -> None:
    client.log_artifact(run_id, payload["local"], payload.get("artifact_dir"))


def send_dataset(client, run_id: str, payload: Dict[str, Any]) -> None:
    """A dataset as an MLflow input (the UI's Dataset column); MLflow keeps its schema and shape, not the data."""
    import warnings

    import mlflow.data
    import numpy as np
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    features = payload["features"]
    if isinstance(features, (str, Path)):  # from a spool (spool.py): the arrays as saved there
        with np.load(features) as saved:
            features = saved[""] if list(saved.keys()) == [""] else {name: saved[name] for name in saved.keys()}
    with warnings.catch_warnings():  # MLflow warns that a local path source is resolved by its registry
        warnings.simplefilter("ignore")
        data = mlflow.data.from_numpy(features, source=payload["source"], name=payload["name"],
                                      digest=payload["digest"])
    tags = [InputTag(MLFLOW_DATASET_CONTEXT, payload["context"])] + [InputTag(k, v) for k, v in payload["tags"].items()]
    for attempt in range(3):
        try:
            client.log_inputs(run_id, datasets=[DatasetInput(data._to_mlflow_entity(), tags=tags)])
            return
        except Exception as exc:  # noqa: BLE001 - MlflowException from a server, IntegrityError from sqlite
            # Two jobs logging the same dataset at once: MLflow's store looks it up, finds none, and both insert it;
            # the loser fails on the unique (experiment, name, digest) constraint (measured: two sweeps on a
            # tracking server). Again, the dataset exists and is only linked to the run.
            if "unique constraint" not in str(exc).lower() or attempt == 2:
                raise
            time.sleep(0.2 * (attempt + 1))


def send_end(client, run_id: str, payload: Dict[str, Any]) -> None:
    client.set_terminated(run_id, payload["status"], end_time=payload["end_time"])


SENDERS: Dict[str, Callable[[Any, str, Dict[str, Any]], None]] = {
    "params": send_params, "tags": send_tags, "metrics": send_metrics, "artifact": send_artifact,
    "dataset": send_dataset, "end": send_end,
}


def patiently(uri: str, outage_s: float, call: Callable[[], Any], sleep: Callable[[float], None] = time.sleep,
              who: str = "the call"):
    """One call to the store, tried again with backoff while the store is away, for up to `outage_s`; then the last
    error raises (a run spools, writer.RunWriter; a sweep's summary and a job's first contact have nothing to spool).
    `who` names what waits, in the two lines the terminal shows."""
    started, delay, away = time.monotonic(), 1.0, False
    while True:
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - an outage is waited for; anything else raises as it was
            waited = time.monotonic() - started
            if not store_is_away(exc) or waited >= outage_s:
                raise
            if not away:
                log.warning("the store at %s does not answer (%s): %s waits for it up to %.0f s (tracking.outage_s)",
                            redact_text(uri), _first_line(exc), who, outage_s)
                away = True
            sleep(min(delay, outage_s - waited))
            delay = min(delay * 2, 30.0)
            continue
        if away:
            log.warning("the store at %s answers again after %.0f s: nothing of %s was lost", redact_text(uri),
                        time.monotonic() - started, who)
        return result


class RunWriter:
    """The writes of one run: sent to the store, tried again while it is away, spooled past `outage_s`."""

    def __init__(self, uri: str, run_id: str, outage_s: float, spool_root: Path,
                 sleep: Callable[[float], None] = time.sleep):
        from mlflow.tracking import MlflowClient

        self.uri, self.run_id, self.outage_s, self.spool_root = uri, run_id, outage_s, Path(spool_root)
        self.client = MlflowClient(uri)
        self.spool = None
        self._sleep = sleep

    def write(self, op: str, payload: Dict[str, Any]) -> None:
        if self.spool is not None:
            self.spool.add(op, payload)
            return
        started = time.monotonic()
        try:
            patiently(self.uri, self.outage_s, lambda: SENDERS[op](self.client, self.run_id, payload),
                      sleep=self._sleep, who=f"run {self.run_id}")
        except Exception as exc:  # noqa: BLE001 - past the limit the record goes to the spool; anything else raises
            if not store_is_away(exc):
                raise
            self._start_spool(op, payload, time.monotonic() - started)

    def _start_spool(self, op: str, payload: Dict[str, Any], waited: float) -> None:
        from qexp.tracking.spool import Spool

        self.spool = Spool.create(self.spool_root, self.uri, self.run_id)
        self.spool.add(op, payload)
        log.warning("the store at %s has not answered for %.0f s: run %s goes on, and keeps its record in %s "
                    "(python -m qexp.store replay uploads it once the store is back)", redact_text(self.uri),
                    waited, self.run_id, self.spool.folder)


def _first_line(exc: BaseException) -> str:
    return redact_text(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")[:200]
