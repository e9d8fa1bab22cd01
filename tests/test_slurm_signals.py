"""How a SLURM job's signals end its run, in-process and without a cluster (tests/test_cluster.py does it with real
jobs): SIGTERM is a pre-emption only when SLURM says the job was chosen for one (PreemptTime), and then it requeues
through submitit's handler; the first signal decides how the job ends, later ones (srun forwarding USR2 again, the
requeue's own SIGTERM) change nothing. `squeue` is replaced by a stand-in (no cluster here), named as such."""

from __future__ import annotations

import os
import signal

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

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    signal.signal(signal.SIGUSR2, submitit_requeue)
    yield calls
    for s, handler in saved.items():
        signal.signal(s, handler)


def _signalled(signum) -> slurm.JobTerminated:
    with pytest.raises(slurm.JobTerminated) as ended:
        os.kill(os.getpid(), signum)
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
