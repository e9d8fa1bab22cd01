"""qexp's SLURM launcher (`hydra/launcher=slurm`): Hydra's submitit SLURM launcher, except that a job lost on the
cluster does not take the sweep down (qexp/tracking/slurm_sweep.py says what becomes of it). It lives here because Hydra
instantiates launchers only from the `hydra_plugins` namespace package."""

from __future__ import annotations

import sys
from typing import Any, List, Sequence

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as UpstreamSlurmLauncher

from qexp.tracking.slurm_sweep import end_lost_job, submission_failed


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
            except Exception as error:  # noqa: BLE001 - sorted out below
                if len(jobs) < len(job_overrides):  # the submission itself failed: one line, as for any bad input
                    print(f"qexp: error: {submission_failed(self, error)}", file=sys.stderr)
                    sys.exit(2)
        finally:
            submitit.AutoExecutor.map_array = original
        results = []
        for num, (overrides, job) in enumerate(zip(job_overrides, jobs), start=initial_job_idx):
            try:
                results.append(job.results()[0])
            except Exception as error:  # noqa: BLE001 - UncompletedJobError, FailedJobError: the job is lost
                results.append(end_lost_job(self, overrides, num, job, error))
        return results
