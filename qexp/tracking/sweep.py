"""Multirun bookkeeping: one MLflow parent run per sweep, job status files, a summary at the end.

Hydra runs the jobs (basic launcher in this process, joblib workers, submitit/SLURM processes); this module only
connects them. The parent run is created by a Hydra callback in the launching process and its id is written to
`<sweep dir>/qexp_sweep.json`. Every job, wherever it runs, reads that file, tags its run as a child
(`mlflow.parentRunId`, the tag the MLflow UI nests by), and writes `<job dir>/qexp_job.json` with what became of it
(finished, failed, skipped). At the end the callback counts those files onto the parent run, prints one summary
line and exits non-zero if a job failed: every job ran, but the sweep is not clean.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import pandas as pd
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from qexp.core.metrics import check as check_metrics
from qexp.tracking.naming import NOTE_TAG, sweep_description
from qexp.core.redact import redact, redact_text

log = logging.getLogger("qexp")

SWEEP_FILE = "qexp_sweep.json"
SWEEP_FILE_ENV = "QEXP_SWEEP_FILE"
JOB_FILE = "qexp_job.json"
PARENT_TAG = "mlflow.parentRunId"
SWEEP_TAG = "qexp.sweep"  # on the parent and on every child: the sweep's name
ROLE_TAG = "qexp.role"  # "sweep" on parent runs (reports leave them out)


@dataclass
class JobRecord:
    status: str  # finished | failed | skipped
    run_id: Optional[str] = None
    config_hash: Optional[str] = None
    overrides: str = ""
    error: Optional[str] = None
    seconds: float = 0.0


@dataclass
class SweepJob:
    """What one job of a multirun knows about its sweep."""

    name: str
    parent_run_id: Optional[str]
    num: int
    output_dir: Path
    overrides: List[str] = field(default_factory=list)
    varied: List[str] = field(default_factory=list)  # the config keys the sweep varies (its runs' names show them)
    started: float = field(default_factory=time.time)

    def tags(self) -> Dict[str, str]:
        tags = {SWEEP_TAG: self.name, "qexp.sweep_job": str(self.num),
                "qexp.sweep_overrides": redact_text(" ".join(self.overrides))}
        if self.parent_run_id:
            tags[PARENT_TAG] = self.parent_run_id
        return tags

    def record(self, status: str, run_id: Optional[str] = None, config_hash: Optional[str] = None,
               error: Optional[str] = None) -> None:
        record = JobRecord(status, run_id, config_hash, redact_text(" ".join(self.overrides)),
                           redact_text(error) if error else None, round(time.time() - self.started, 1))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / JOB_FILE).write_text(json.dumps(asdict(record), indent=1))


def current_job(sweep_name: Optional[str] = None) -> Optional[SweepJob]:
    """The running job's sweep, or None outside a Hydra multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    # The launcher's environment points at the sweep file (absolute), whatever directory a launcher starts jobs in;
    # the sweep dir is the fallback for launchers that do not pass the environment on.
    info = read_sweep_file(Path(hydra_cfg.sweep.dir).resolve()) or {}
    return SweepJob(
        name=info.get("name") or sweep_name or "multirun",
        parent_run_id=info.get("parent_run_id"),
        num=int(hydra_cfg.job.num),
        output_dir=Path(hydra_cfg.runtime.output_dir),
        overrides=list(hydra_cfg.overrides.task),
        varied=list(info.get("varied", [])),
    )


def read_sweep_file(sweep_dir: Path) -> Optional[dict]:
    """The sweep's parent run, store and name, as the launching process wrote them (None: no such file)."""
    sweep_file = Path(os.environ.get(SWEEP_FILE_ENV) or Path(sweep_dir) / SWEEP_FILE)
    return json.loads(sweep_file.read_text()) if sweep_file.exists() else None


_SWEEP_SYNTAX = (",", "choice(", "range(", "interval(", "glob(", "tag(")


def varied_keys(task_overrides: List[str], sweeper_params: dict) -> List[str]:
    """The keys a multirun sweeps: its sweeper's grid, and command-line overrides with sweep syntax (`a=x,y`)."""
    keys = {str(k).lstrip("+~") for k in sweeper_params}
    for override in task_overrides:
        key, _, value = override.partition("=")
        if any(token in value for token in _SWEEP_SYNTAX):
            keys.add(key.lstrip("+~"))
    return sorted(keys)


def sweep_name(config: DictConfig) -> str:
    choice = OmegaConf.select(config, "hydra.runtime.choices.sweep")
    return OmegaConf.select(config, "tracking.sweep") or choice or "multirun"


def read_job_records(sweep_dir: Path) -> pd.DataFrame:
    rows = []
    for path in sorted(sweep_dir.glob(f"**/{JOB_FILE}")):
        rows.append({"job_dir": str(path.parent.relative_to(sweep_dir)), **json.loads(path.read_text())})
    columns = ["job_dir"] + list(JobRecord.__dataclass_fields__)
    return pd.DataFrame(rows, columns=columns)


def _fail_loudly(method):
    """Hydra logs an exception raised in a callback as a warning and carries on, so the sweep's bookkeeping (parent
    run, summary, exit status) would vanish silently. Any failure here ends the command instead: one line, exit 1
    (exit 2 for the user's input or environment, e.g. an unreachable tracking server)."""
    import functools

    @functools.wraps(method)
    def wrapper(self, config: DictConfig, **kwargs: Any) -> None:
        from qexp.core.errors import QexpError

        try:
            return method(self, config, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported in one line, then the command fails
            print(f"qexp: error: sweep bookkeeping failed ({method.__name__}): {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
            sys.exit(2 if isinstance(exc, QexpError) else 1)

    return wrapper


def _sweeper_params(config: DictConfig) -> dict:
    """The grid of a sweep file (hydra.sweeper.params); an ad-hoc `-m a=x,y` multirun has none (its grid is in the
    overrides)."""
    params = config.hydra.sweeper.get("params")
    return OmegaConf.to_container(params, resolve=False) if OmegaConf.is_config(params) else dict(params or {})


class SweepCallback(Callback):
    """Hydra callback (conf/config.yaml: hydra.callbacks.qexp_sweep): the parent run of a multirun."""

    @_fail_loudly
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from mlflow.tracking import MlflowClient

        from qexp.core.liveness import owner_tags
        from qexp.tracking.store import Tracker

        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        name = sweep_name(config)
        tracker = Tracker(config.tracking)
        experiment_id = tracker.connect()  # also the unreachable-server check, before any job starts
        client = MlflowClient(tracker.uri)
        command = redact_text("python -m qexp " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
        sweep_params = redact(_sweeper_params(config))
        run = client.create_run(experiment_id, run_name=f"sweep:{name}", tags={
            ROLE_TAG: "sweep", SWEEP_TAG: name, "sweep_dir": str(sweep_dir), "command": command,
            "launcher": str(config.hydra.launcher.get("_target_", "")), **owner_tags(),
        })
        overrides = [redact_text(o) for o in config.hydra.overrides.task]
        client.log_param(run.info.run_id, "sweep.overrides", " ".join(overrides)[:6000])
        client.log_param(run.info.run_id, "sweep.params", json.dumps(sweep_params)[:6000])
        client.log_text(run.info.run_id, OmegaConf.to_yaml({
            "command": command, "overrides": overrides, "sweeper_params": sweep_params,
            "launcher": redact(OmegaConf.to_container(config.hydra.launcher, resolve=False)),
        }), "sweep.yaml")
        os.environ[SWEEP_FILE_ENV] = str(sweep_dir / SWEEP_FILE)  # inherited by joblib / submitit job processes
        # Holds the tracking URI unmasked (the jobs and the end callback connect with it): owner-readable only.
        sweep_file = sweep_dir / SWEEP_FILE
        os.close(os.open(sweep_file, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
        sweep_file.write_text(json.dumps({
            "name": name, "parent_run_id": run.info.run_id, "tracking_uri": tracker.uri,
            "experiment_id": experiment_id, "command": command,
            "varied": varied_keys(list(config.hydra.overrides.task), _sweeper_params(config)),
        }, indent=1))
        self._start = time.time()
        log.info("sweep %r: parent MLflow run %s, jobs in %s", name, run.info.run_id, sweep_dir)

    @_fail_loudly
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from mlflow.tracking import MlflowClient

        from qexp.tracking.writer import patiently

        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        os.environ.pop(SWEEP_FILE_ENV, None)
        if (sweep_dir / "multirun.yaml").is_file():  # Hydra writes the command line's values as given
            (sweep_dir / "multirun.yaml").write_text(redact_text((sweep_dir / "multirun.yaml").read_text()))
        info = json.loads((sweep_dir / SWEEP_FILE).read_text())
        jobs = read_job_records(sweep_dir)
        counts = {status: int((jobs["status"] == status).sum()) for status in ("finished", "failed", "skipped")}
        client = MlflowClient(info["tracking_uri"])
        parent = info["parent_run_id"]

        def send(write, *args):  # the store may be restarting as the sweep ends: wait as its jobs did
            patiently(info["tracking_uri"], config.tracking.outage_s, lambda: write(parent, *args),
                      who="the sweep's summary")

        check_metrics([f"jobs_{status}" for status in counts] + ["jobs_total", "time_sweep_s"])
        for status, count in counts.items():
            send(client.log_metric, f"jobs_{status}", count)
        send(client.log_metric, "jobs_total", len(jobs))
        send(client.log_metric, "time_sweep_s", round(time.time() - getattr(self, "_start", time.time()), 1))
        send(client.log_text, jobs.to_csv(index=False), "jobs.csv")
        if counts["failed"]:
            failed = jobs[jobs["status"] == "failed"]
            send(client.set_tag, "error", "; ".join(f"[{r.overrides}] {r.error}" for r in failed.itertuples())[:5000])
        send(client.set_tag, NOTE_TAG, sweep_description(info["name"], counts, config.tracking.experiment))
        send(client.set_terminated, "FAILED" if counts["failed"] else "FINISHED")
        summary = ", ".join(f"{count} {status}" for status, count in counts.items())
        print(f"qexp: sweep {info['name']!r} ({len(jobs)} jobs): {summary}; parent run {parent}; "
              f"table: python -m qexp.report --experiment {config.tracking.experiment} --sweep {info['name']}")
        if counts["failed"]:
            for row in jobs[jobs["status"] == "failed"].itertuples():
                print(f"qexp: failed job [{row.overrides}]: {row.error}", file=sys.stderr)
            sys.exit(1)
