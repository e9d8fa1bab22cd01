"""How a SLURM job's signals end its run, in-process and without a cluster (tests/test_cluster.py does it with real
jobs): SIGTERM is a pre-emption only when SLURM says the job was chosen for one (PreemptTime), and then it requeues
through submitit's handler; the first signal decides how the job ends, later ones (srun forwarding USR2 again, the
requeue's own SIGTERM) change nothing; and how the launcher ends a lost job's run. `squeue`, `sacct` and Hydra's
launcher object are replaced by stand-ins (no cluster here), named as such."""

from __future__ import annotations

import os
import signal
import time

import pytest

from qexp.tracking import slurm


@pytest.fixture
def job(monkeypatch):
    """This process as SLURM job 7 started by submitit: a stand-in for submitit's USR2 handler that requeues (exits
    -1, as submitit does) and counts its calls; the handlers are restored afterwards."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    calls = []

    def submitit_requeue(signum, frame):
        calls.append(signum)
        raise SystemExit(-1)

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2, signal.SIGALRM)}
    signal.signal(signal.SIGUSR2, submitit_requeue)
    yield calls
    signal.setitimer(signal.ITIMER_REAL, 0)
    slurm._pending.clear()
    for s, handler in saved.items():
        signal.signal(s, handler)


def _signalled(signum) -> slurm.JobTerminated:
    with pytest.raises(slurm.JobTerminated) as ended:
        os.kill(os.getpid(), signum)
    ended.value.caught()  # as the tracker does when it ends the run
    return ended.value


def test_sigterm_of_a_preempted_job_requeues_it_through_submitit(job, monkeypatch):
    monkeypatch.setattr(slurm, "preempt_time", lambda job_id: "2026-11-29T05:49:51")  # stand-in for squeue
    slurm.install_job_signals()
    ended = _signalled(signal.SIGTERM)
    assert ended.what == "pre-empted by SLURM and requeued by submitit" and ended.exit_code == -1
    assert job == [signal.SIGUSR2]
    os.kill(os.getpid(), signal.SIGUSR2)  # srun forwards the signal again: ignored, no second requeue
    os.kill(os.getpid(), signal.SIGTERM)
    assert job == [signal.SIGUSR2]


def test_sigterm_of_a_job_not_preempted_ends_it(job, monkeypatch):
    monkeypatch.setattr(slurm, "preempt_time", lambda job_id: None)  # stand-in for squeue: PreemptTime N/A
    slurm.install_job_signals()
    ended = _signalled(signal.SIGTERM)
    assert ended.what.startswith("ended by SLURM (SIGTERM") and ended.exit_code is None and job == []


def test_a_requeue_that_fails_is_said_and_not_taken_for_a_time_limit(job, monkeypatch):
    def scontrol_refuses(signum, frame):
        raise RuntimeError("Command '['scontrol', 'requeue', '7']' returned non-zero exit status 1.")

    signal.signal(signal.SIGUSR2, scontrol_refuses)
    slurm.install_job_signals()
    ended = _signalled(signal.SIGUSR2)
    assert ended.what.startswith("pre-empted by SLURM; submitit could not requeue it") and not ended.time_limit


def test_an_end_signalled_inside_a_finalizer_is_raised_again(job, monkeypatch):
    """Python only prints an exception raised while a `__del__` runs (GitPython's, in a real job): the job must not go
    on working until SLURM kills it, so the end is raised again, every second, until the run has been ended."""
    monkeypatch.setattr(slurm, "preempt_time", lambda job_id: None)  # stand-in for squeue: not pre-empted
    slurm.install_job_signals()

    class SignalledInItsFinalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler's exception is "ignored" here

    started = time.monotonic()
    with pytest.raises(slurm.JobTerminated) as ended:
        SignalledInItsFinalizer()  # gone at once
        time.sleep(10)  # the job's work goes on: the end comes again within a second
    assert time.monotonic() - started < 5
    ended.value.caught()
    assert ended.value.what.startswith("ended by SLURM (SIGTERM")
    time.sleep(1.5)  # caught: not raised again


def test_a_lost_jobs_run_ended_by_another_process_gets_slurms_account(tmp_path, monkeypatch):
    """Another qexp process on the node found the job's process gone and ended its run KILLED first, able to say only
    that it was gone: the launcher adds what SLURM says of the job (the run of a job still RUNNING it ends itself)."""
    import json
    from types import SimpleNamespace

    import mlflow
    from omegaconf import OmegaConf

    from qexp.tracking import slurm_sweep
    from qexp.core.liveness import KILLED_TAG
    from qexp.tracking.sweep import PARENT_TAG, SWEEP_FILE, SWEEP_FILE_ENV

    monkeypatch.delenv(SWEEP_FILE_ENV, raising=False)
    monkeypatch.setattr(slurm_sweep, "sacct_state", lambda job_id: "CANCELLED by 0")  # stand-in for sacct
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    experiment = client.create_experiment("slurm", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment).info.run_id
    runs = {}
    for num in (0, 1):
        runs[num] = client.create_run(experiment, tags={PARENT_TAG: parent, "qexp.sweep_job": str(num)}).info.run_id
    gone = "its process 24670 on vm is gone (killed, out of memory, or a native crash); found by qexp pid 24923"
    client.set_tag(runs[0], KILLED_TAG, gone)
    client.set_terminated(runs[0], "KILLED")
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (sweep_dir / SWEEP_FILE).write_text(json.dumps({"name": "s", "parent_run_id": parent, "experiment_id": experiment,
                                                    "tracking_uri": client.tracking_uri}))
    launcher = SimpleNamespace(config=OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}}))  # Hydra's
    for num in (0, 1):
        slurm_sweep.end_lost_job(launcher, [f"+slurmtest=j{num}"], num, SimpleNamespace(job_id=f"41_{num}"),
                                 RuntimeError("job 41 has not produced any output"))
    ended = {num: client.get_run(run_id) for num, run_id in runs.items()}
    assert ended[0].data.tags[KILLED_TAG].startswith(gone + "; SLURM job 41_0: CANCELLED by 0")
    assert ended[1].info.status == "KILLED" and "SLURM job 41_1: CANCELLED by 0" in ended[1].data.tags[KILLED_TAG]
    slurm_sweep.end_lost_job(launcher, ["+slurmtest=j0"], 0, SimpleNamespace(job_id="41_0"), RuntimeError("again"))
    assert client.get_run(runs[0]).data.tags[KILLED_TAG].count("SLURM job") == 1  # said once
    # the job ended its run itself on SIGTERM while accounting had no record of it yet: completed with the account
    own = "ended by SLURM (SIGTERM: scancel, its time limit or its node shutting down); SLURM job 41_2"
    tags = {PARENT_TAG: parent, "qexp.sweep_job": "2", KILLED_TAG: own}
    runs[2] = client.create_run(experiment, tags=tags).info.run_id
    client.set_terminated(runs[2], "KILLED")
    for _ in range(2):
        slurm_sweep.end_lost_job(launcher, ["+slurmtest=j2"], 2, SimpleNamespace(job_id="41_2"), RuntimeError("gone"))
    assert client.get_run(runs[2]).data.tags[KILLED_TAG] == own + ": CANCELLED by 0"
