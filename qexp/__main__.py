"""`python -m qexp [+experiment=NAME] [group=value ...] [key=value ...]`: run one experiment (or a Hydra multirun)."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys

import hydra
from omegaconf import DictConfig

import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
from qexp.core.errors import QexpError
from qexp.core.redact import mask_log_records


# A native crash (a segfault in QNN's emulator) kills the process before Python can report anything: faulthandler
# prints where it happened, on a copy of the terminal's stderr because the deploy stage sends fd 2 to native.log.
# The tracking watchdog then ends the run KILLED (qexp/tracking/watchdog.py).
_TERMINAL_STDERR = os.fdopen(os.dup(2), "w")
faulthandler.enable(file=_TERMINAL_STDERR, all_threads=False)
# torch warns twice on import that two enums torchao registers with its pytree are natively supported now: a
# deprecation notice for torchao's maintainers, not for the user's terminal.
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
mask_log_records()  # before Hydra logs anything: its launcher prints each job's overrides, passwords included


def _failure_line(exc: Exception) -> str:
    """The one line a failed run prints."""
    from qexp.core.redact import redact_text

    if isinstance(exc, QexpError):  # no traceback: the error is the user's input or environment
        return redact_text(f"qexp: error: {exc}")
    # a bug or an upstream failure
    first_line = redact_text(str(exc).splitlines()[0]) if str(exc) else ""
    message = (f"qexp: failed: {type(exc).__name__}: {first_line} (traceback: error.txt of the MLflow run, "
               "or rerun with QEXP_TRACEBACK=1)")
    if "database is locked" in str(exc):  # measured: the sqlite store loses writers beyond ~32 at once
        message += ("; the embedded sqlite store has too many parallel writers: lower "
                    "hydra.launcher.n_jobs or log to a tracking server (mlflow server)")
    return message


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from qexp.pipeline import run_experiment
    from qexp.core.redact import redact_hydra_outputs, redact_text
    from qexp.tracking.sweep import current_job

    from qexp.tracking.slurm import JobTerminated, install_job_signals

    redact_hydra_outputs()
    job = current_job(cfg.tracking.sweep)
    install_job_signals()  # in a SLURM job: its end (scancel, time limit) ends the run KILLED with SLURM's reason
    try:
        result = run_experiment(cfg, job)
    except KeyboardInterrupt:
        print("qexp: interrupted", file=sys.stderr)
        sys.exit(130)
    except JobTerminated as ended:
        from qexp.tracking.slurm import slurm_reason

        ended.caught()

        run_id = getattr(ended, "run_id", None)
        if ended.reason == ended.what:  # ended before a run could say why: ask SLURM now
            slurm_reason(ended)
        print(redact_text(f"qexp: error: run {run_id} KILLED: {ended.reason}"), file=sys.stderr)
        if job is not None:
            job.record("failed", run_id, getattr(ended, "config_hash", None), f"KILLED: {ended.reason}")
        if ended.exit_code is not None:  # submitit requeued the job and exits with this
            sys.exit(ended.exit_code)
        if job is None:
            sys.exit(143)
        return None  # the job's end is recorded: the sweep's summary counts it failed
    except Exception as exc:  # noqa: BLE001 - reported in one line; details in the MLflow run
        if not isinstance(exc, QexpError) and os.environ.get("QEXP_TRACEBACK"):
            raise
        message = _failure_line(exc)
        if job is not None:
            # In a sweep a failed job must not stop the others: record it and return; the sweep's summary
            # reports it and sets the exit code.
            job.record("failed", getattr(exc, "run_id", None), getattr(exc, "config_hash", None), str(exc)[:2000])
            print(f"{message} [job {job.num}: {' '.join(job.overrides)}]", file=sys.stderr)
            return None
        print(message, file=sys.stderr)
        sys.exit(2 if isinstance(exc, QexpError) else 1)
    if result.skipped:
        print(f"qexp: skipped: config hash {result.tags['config_hash']} already has FINISHED run {result.run_id} "
              "(tracking.force=true reruns it)")
        return None
    headline = ("ppl_fp", "ppl_fp_transformed", "ppl_qdq", "ppl_deployed")
    summary = "  ".join(f"{k}={result.metrics[k]:.4g}" for k in headline if k in result.metrics)
    print(f"qexp: run {result.run_id} ({result.name}) finished: {summary}\n"
          f"qexp: {result.description}  [all metrics: `make ui`, or python -m qexp.report --compare "
          f"{result.run_id[:8]} OTHER_RUN]")
    return result.metrics.get("ppl_qdq", result.metrics.get("ppl_fp"))


if __name__ == "__main__":
    main()
