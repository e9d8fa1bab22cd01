"""Sweeps on SLURM (`hydra/launcher=slurm`): every job ends its run with what SLURM did to it.

Hydra's submitit launcher submits the jobs as one array. Two things it leaves open, which this module closes:
- In the job: SLURM ends a job with SIGTERM (`scancel`, the time limit, a node going down) and warns of the time
  limit with USR2 `signal_delay_s` before it. submitit ignores SIGTERM and turns USR2 into an exception only when the
  job cannot be requeued. Here both end the run KILLED at once, with SLURM's own account of the job (`sacct`) as the
  reason; a job submitit requeues (pre-emption) ends its run KILLED as requeued and exits as submitit wants. A
  pre-empted job may get SIGTERM instead of USR2 (GraceTime without preempt_send_user_signal): SLURM's PreemptTime
  tells the two apart, and the pre-empted job is requeued all the same. The handler's exception is raised again
  every second until the run has been ended with it: a signal that lands while a finalizer runs would otherwise be
  lost, and the job would work on until SLURM kills it.
- In the launching process: a job that died without a word (SIGKILL, a node failure, cancelled while still pending)
  makes submitit's `results()` raise, which would end the whole sweep with a traceback and leave the job's run
  RUNNING. qexp's launcher (hydra_plugins/qexp_slurm_launcher: Hydra finds launchers only there) catches it per
  job: `slurm_sweep.end_lost_job` asks `sacct` what happened, ends the job's run KILLED with that reason (if the job
  got as far as starting one; a run already ended without SLURM's account gets it added), records the job as failed
  for the sweep's summary, and lets the others' results stand.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from typing import Optional

from qexp.core.liveness import slurm_job_id

log = logging.getLogger("qexp")


class JobTerminated(BaseException):
    """SLURM is ending this job. A BaseException, like KeyboardInterrupt: no `except Exception` may swallow it."""

    def __init__(self, what: str, exit_code: Optional[int] = None, time_limit: bool = False):
        super().__init__(what)
        self.what = what
        self.time_limit = time_limit  # the time-limit warning: the job is still RUNNING for SLURM
        self.exit_code = exit_code  # set: exit with it after the run is ended (submitit requeued the job)
        self.reason = what  # completed from sacct by slurm_reason() once out of the signal handler

    def caught(self) -> None:
        """The job is being ended with this exception: stop raising it again (see `_raise`)."""
        signal.setitimer(signal.ITIMER_REAL, 0)
        _pending.clear()


_pending: list = []  # the JobTerminated a signal raised, until whoever ends the run says it has caught it


def _raise(exc: JobTerminated) -> None:
    """Raise `exc` from the signal handler, and again every second until `exc.caught()`: Python only prints an
    exception raised while a finalizer (`__del__`, e.g. GitPython's) runs, and the job would go on working until
    SLURM kills it, its run left RUNNING."""
    _pending[:] = [exc]
    signal.signal(signal.SIGALRM, _raise_again)
    signal.setitimer(signal.ITIMER_REAL, 1.0, 1.0)
    raise exc


def _raise_again(signum, frame) -> None:
    if _pending:
        raise _pending[0]


def sacct_state(job_id: str) -> Optional[str]:
    """SLURM's account of a job, e.g. "CANCELLED by 0", "TIMEOUT", "FAILED, exit code 9:0", or None if unknown."""
    try:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "State,ExitCode"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.split("|") for line in out.splitlines() if line.strip()]
    if not lines:
        return None
    # not sacct's Reason: for a finished job it is the last reason it was pending for (e.g. JobArrayTaskLimit)
    state, exit_code = (lines[-1] + ["", ""])[:2]
    return f"{state}, exit code {exit_code}" if exit_code and exit_code != "0:0" else state


def _squeue(job_id: str, *format_args: str) -> str:
    """squeue's line for the job in the given format, "" when squeue cannot answer."""
    try:
        return subprocess.run(["squeue", "-h", "-j", str(job_id), *format_args], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def squeue_times(job_id: str) -> Optional[str]:
    """How long the job has run of its time limit, e.g. "ran 0:31 of 1:00", or None."""
    used, _, limit = _squeue(job_id, "-o", "%M|%l").partition("|")
    return f"ran {used} of {limit}" if used and limit else None


def _sacct_state_soon(job_id: str, tries: int = 3) -> Optional[str]:
    """sacct_state, asked again for a moment while accounting has no record yet (slurmctld passes a new array task's
    record to slurmdbd later under load); short, because SIGKILL follows SIGTERM after the cluster's KillWait."""
    for attempt in range(tries):
        state = sacct_state(job_id)
        if state or attempt == tries - 1:
            return state
        time.sleep(1.0)
    return None


def _describe(exc: "JobTerminated") -> str:
    job_id = slurm_job_id()
    account = (squeue_times if exc.time_limit else _sacct_state_soon)(job_id) if job_id else None
    return f"{exc.what}; SLURM job {job_id}: {account}" if account else f"{exc.what}; SLURM job {job_id}"


def slurm_reason(exc: BaseException) -> str:
    """The reason a terminated job's run is KILLED, with what sacct says of the job now."""
    if isinstance(exc, JobTerminated):
        exc.reason = _describe(exc)
        return exc.reason
    return str(exc)


def preempt_time(job_id: str) -> Optional[str]:
    """When SLURM chose this job for pre-emption (squeue's PreemptTime), or None: not pre-empted, or unknown."""
    out = _squeue(job_id, "-O", "PreemptTime")
    return out if out and out not in ("N/A", "None", "Unknown") else None


def install_job_signals() -> None:
    """In a SLURM job: SIGTERM and the time-limit warning end the run (see the module's docstring)."""
    if not slurm_job_id():
        return
    submitit_handler = signal.getsignal(signal.SIGUSR2)
    started_by_submitit = callable(submitit_handler)
    ending = []  # the first signal decides how the job ends; later ones (srun forwards USR2 again, the requeue's
    # SIGTERM) must not replace it while the run is being ended

    def on_warning(signum, frame):
        if ending:
            return
        ending.append(signum)
        try:
            submitit_handler(signum, frame)  # requeues (exits) or raises when it cannot
        except SystemExit as requeued:
            ended = JobTerminated("pre-empted by SLURM and requeued by submitit", exit_code=requeued.code)
        except Exception as cannot:  # noqa: BLE001 - submitit's UncompletedJobError, or scontrol failing
            if type(cannot).__name__ != "UncompletedJobError":
                ended = JobTerminated(f"pre-empted by SLURM; submitit could not requeue it ({cannot})")
            else:
                ended = JobTerminated(f"reached its SLURM time limit (USR2 signal_delay_s before it; {cannot})",
                                      time_limit=True)
        else:
            return
        _raise(ended)

    def on_term(signum, frame):
        if ending:
            return
        # A pre-empted job gets SIGTERM at the start of its partition's GraceTime (SLURM sends the --signal instead
        # only with SchedulerParameters=preempt_send_user_signal): that is a requeue, not an end, so it goes the way
        # submitit's USR2 goes (requeue, then exit); outside submitit SLURM requeues the job itself.
        if preempt_time(slurm_job_id()):
            if started_by_submitit:
                on_warning(signal.SIGUSR2, frame)
            ending.append(signum)
            _raise(JobTerminated("pre-empted by SLURM (SIGTERM at the start of its grace time; SLURM requeues it)"))
        ending.append(signum)
        _raise(JobTerminated("ended by SLURM (SIGTERM: scancel, its time limit or its node shutting down)"))

    signal.signal(signal.SIGTERM, on_term)
    if started_by_submitit:  # not started by submitit: USR2 only if the user asked for it
        signal.signal(signal.SIGUSR2, on_warning)
