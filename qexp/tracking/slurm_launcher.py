"""Hydra's submitit SLURM launcher (`hydra/launcher=slurm`), except that a job lost on the cluster does not take the
sweep down.

A job that died without a word (SIGKILL, a node failure, cancelled while still pending) makes submitit's `results()`
raise, which would end the whole sweep with a traceback and leave the job's run RUNNING. Here the launcher asks
`sacct` what happened, ends the job's run KILLED with that reason (if the job got as far as starting one), records the
job as failed for the sweep's summary, and lets the other jobs' results stand. Jobs that live to see their end
report it themselves (qexp/tracking/slurm.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Sequence

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as UpstreamSlurmLauncher

from qexp.tracking.slurm import sacct_state


def _lost_job(launcher, overrides: Sequence[str], num: int, job, error: BaseException):
    """A job whose process never reported back: end its run KILLED with SLURM's reason and record it failed."""
    import mlflow
    from hydra.core.utils import JobReturn, JobStatus

    from qexp.tracking.liveness import KILLED_TAG
    from qexp.tracking.sweep import PARENT_TAG, SweepJob, read_sweep_file

    state = sacct_state(job.job_id) or "unknown to sacct"
    reason = f"SLURM job {job.job_id}: {state} (the job never reported back: {str(error).splitlines()[0][:300]})"
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir)).resolve()
    info = read_sweep_file(sweep_dir)
    run_id = None
    if info is not None:
        client = mlflow.MlflowClient(info["tracking_uri"])
        runs = client.search_runs([info["experiment_id"]], filter_string=(
            f"tags.`{PARENT_TAG}` = '{info['parent_run_id']}' and tags.`qexp.sweep_job` = '{num}' "
            "and attributes.status = 'RUNNING'"))
        for run in runs:
            run_id = run.info.run_id
            client.set_tag(run_id, KILLED_TAG, reason[:5000])
            client.set_tag(run_id, "error", f"KILLED: {reason}"[:5000])
            client.set_terminated(run_id, "KILLED")
    job_dir = sweep_dir / str(num)  # hydra.sweep.subdir's default, which the slurm launcher config keeps
    record = SweepJob(str(info["name"]) if info else "", None, num, job_dir, list(overrides))
    if not (job_dir / "qexp_job.json").exists():
        record.record("failed", run_id, None, f"KILLED: {reason}")
    print(f"qexp: job {num} [{' '.join(overrides)}] KILLED: {reason}", flush=True)
    ret = JobReturn(overrides=list(overrides), cfg=None, hydra_cfg=None, working_dir=str(job_dir), task_name="")
    ret.status, ret.return_value = JobStatus.COMPLETED, None  # recorded above: the sweep's summary counts it failed
    return ret


class SlurmLauncher(UpstreamSlurmLauncher):
    """Hydra's submitit SLURM launcher, except that a job lost on the cluster does not take the sweep down."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[Any]:
        import submitit

        jobs = []
        original = submitit.AutoExecutor.map_array

        def keep(executor, *args, **kwargs):
            jobs.extend(original(executor, *args, **kwargs))
            return jobs

        # upstream's launch() submits with map_array and then calls results() on each job, which raises for a
        # lost one: submit through it with results() deferred, then collect them here
        submitit.AutoExecutor.map_array = keep
        try:
            try:
                return super().launch(job_overrides, initial_job_idx)
            except submitit.core.utils.UncompletedJobError:
                pass
        finally:
            submitit.AutoExecutor.map_array = original
        results = []
        for num, (overrides, job) in enumerate(zip(job_overrides, jobs), start=initial_job_idx):
            try:
                results.append(job.results()[0])
            except Exception as error:  # noqa: BLE001 - UncompletedJobError, FailedJobError: the job is lost
                results.append(_lost_job(self, overrides, num, job, error))
        return results
