"""The launching side of a SLURM sweep (qexp's launcher, hydra_plugins/qexp_slurm_launcher, calls these): a job
lost on the cluster, and a submission sbatch refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from qexp.tracking.slurm import sacct_state


def end_lost_job(launcher, overrides: Sequence[str], num: int, job, error: BaseException):
    """A job whose process never reported back: end its run KILLED with SLURM's reason and record it failed."""
    import mlflow
    from hydra.core.utils import JobReturn, JobStatus

    from qexp.core.liveness import KILLED_TAG
    from qexp.tracking.sweep import PARENT_TAG, SweepJob, read_sweep_file

    account = sacct_state(job.job_id)
    state = account or "unknown to sacct"
    reason = f"SLURM job {job.job_id}: {state} (the job never reported back: {str(error).splitlines()[0][:300]})"
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir)).resolve()
    info = read_sweep_file(sweep_dir)
    run_id = None
    if info is not None:
        client = mlflow.MlflowClient(info["tracking_uri"])
        runs = client.search_runs([info["experiment_id"]], filter_string=(
            f"tags.`{PARENT_TAG}` = '{info['parent_run_id']}' and tags.`qexp.sweep_job` = '{num}'"))
        for run in runs:
            known = run.data.tags.get(KILLED_TAG, "")
            if run.info.status == "RUNNING":
                said = reason
            elif run.info.status == "KILLED" and "SLURM job" not in known:
                # another qexp process on the node found the job's process gone first and could only say that it
                # was: SLURM's account (scancel, the time limit, the OOM killer) is the reason the user needs
                said = f"{known}; {reason}"
            elif run.info.status == "KILLED" and account and known.rstrip().endswith(f"SLURM job {job.job_id}"):
                # the job ended its run itself on SIGTERM, before accounting had its record (slurmdbd lags under
                # load): the launcher, asking later, completes the job's own line with SLURM's account
                said = f"{known.rstrip()}: {account}"
            else:
                continue
            run_id = run.info.run_id
            client.set_tag(run_id, KILLED_TAG, said[:5000])
            client.set_tag(run_id, "error", f"KILLED: {said}"[:5000])
            if run.info.status == "RUNNING":
                client.set_terminated(run_id, "KILLED")
    job_dir = sweep_dir / str(num)  # hydra.sweep.subdir's default, which the slurm launcher config keeps
    record = SweepJob(str(info["name"]) if info else "", None, num, job_dir, list(overrides))
    if not (job_dir / "qexp_job.json").exists():
        record.record("failed", run_id, None, f"KILLED: {reason}")
    print(f"qexp: job {num} [{' '.join(overrides)}] KILLED: {reason}", flush=True)
    ret = JobReturn(overrides=list(overrides), cfg=None, hydra_cfg=None, working_dir=str(job_dir), task_name="")
    ret.status, ret.return_value = JobStatus.COMPLETED, None  # recorded above: the sweep's summary counts it failed
    return ret


def submission_failed(launcher, error: BaseException) -> BaseException:
    """sbatch refused the sweep: end the sweep's parent run FAILED with sbatch's words; the error to raise."""
    import mlflow

    from qexp.core.errors import QexpError
    from qexp.tracking.sweep import read_sweep_file

    lines = [line for line in str(error).splitlines() if "error" in line.lower() or "fatal" in line.lower()]
    message = f"sbatch refused the sweep's jobs: {(lines or str(error).splitlines() or ['?'])[-1].strip()[:500]}"
    info = read_sweep_file(Path(str(launcher.config.hydra.sweep.dir)).resolve())
    if info is not None:
        client = mlflow.MlflowClient(info["tracking_uri"])
        client.set_tag(info["parent_run_id"], "error", message)
        client.set_terminated(info["parent_run_id"], "FAILED")
    return QexpError(message, "check hydra.launcher's partition, time and memory against `sinfo`, and that this host "
                              "can reach slurmctld (SLURM_CONF)")
