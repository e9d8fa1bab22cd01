"""Reliability: runs whose process died are reconciled to KILLED, and the report says it left them out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from mlflow.tracking import MlflowClient

from helpers import REPO, TINY

EXPERIMENT = "reliability_kill"


def _command(sweep_dir):
    return [sys.executable, "-m", "qexp", "-m", *TINY, "eval.limit=2", "quant=fp32,16a8w,8a8w",
            f"tracking.experiment={EXPERIMENT}", f"hydra.sweep.dir={sweep_dir}"]


def _runs(client):
    experiment = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([experiment.experiment_id], max_results=100) if experiment else []


def test_sigkilled_sweep_is_reconciled_on_the_next_touch(cache_dir, store_uri, tmp_path):
    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir), "MLFLOW_TRACKING_URI": store_uri}
    client = MlflowClient(store_uri)
    first = subprocess.Popen(_command(tmp_path / "killed"), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    try:
        while time.time() < deadline:  # kill it while its second job runs (the first one has finished)
            runs = _runs(client)
            if any(r.info.status == "FINISHED" for r in runs) and any(
                    r.info.status == "RUNNING" and "mlflow.parentRunId" in r.data.tags for r in runs):
                break
            assert first.poll() is None, "the sweep ended before it could be killed"
            time.sleep(0.2)
        else:
            raise AssertionError("the second job never started")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The watchdog of the killed process ends its parent run and its interrupted child KILLED within seconds.
    deadline = time.time() + 60
    while any(r.info.status == "RUNNING" for r in _runs(client)) and time.time() < deadline:
        time.sleep(0.5)
    before = {r.info.run_id: r.info.status for r in _runs(client)}
    assert sorted(before.values()) == ["FINISHED", "KILLED", "KILLED"], before

    rerun = subprocess.run(_command(tmp_path / "rerun"), cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "1 skipped" in rerun.stdout and "2 finished" in rerun.stdout  # the finished job is not redone
    after = {r.info.run_id: r for r in _runs(client)}
    for run_id, status in before.items():
        if status == "KILLED":
            run = after[run_id]
            assert run.info.status == "KILLED"
            assert "died without ending the run" in run.data.tags["qexp.killed_reason"], run.data.tags
            assert run.data.tags["qexp.pid"] == str(first.pid)
    assert not [r for r in after.values() if r.info.status == "RUNNING"]

    report = subprocess.run([sys.executable, "-m", "qexp.report", "--experiment", EXPERIMENT, "--out-dir",
                             str(tmp_path / "results")], cwd=REPO, env=env, capture_output=True, text=True)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "left out (never finished): 1 KILLED" in report.stdout
    assert "1 KILLED" in (tmp_path / "results" / f"{EXPERIMENT}.md").read_text()


def test_a_live_run_and_another_hosts_run_are_never_touched():
    from qexp.core.liveness import death_reason, owner_tags

    mine = owner_tags()
    assert death_reason(mine) is None  # this very process is alive
    assert death_reason({**mine, "qexp.host": "another-host"}) is None  # may be alive there
    assert death_reason({}) is None  # no owner recorded: unknown, left alone
    assert "rebooted" in death_reason({**mine, "qexp.boot_id": "an-earlier-boot"})
    assert "another process" in death_reason({**mine, "qexp.pid_start": "1"})  # pid reused
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert "is gone" in death_reason(owner_tags(os.getpid()) | {"qexp.pid": str(child.pid)})


def test_dead_runs_are_reconciled_the_next_time_qexp_touches_the_experiment(store_uri):
    """Without a watchdog (power loss, or it was killed too), the next connect to the experiment does it."""
    from qexp.core.config import TrackingConfig
    from qexp.core.liveness import owner_tags
    from qexp.tracking.store import Tracker

    client = MlflowClient(store_uri)
    experiment_id = client.create_experiment("reliability_touch")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = client.create_run(experiment_id, tags=owner_tags() | {"qexp.pid": str(child.pid)})
    elsewhere = client.create_run(experiment_id, tags=owner_tags() | {"qexp.host": "another-host"})
    alive = client.create_run(experiment_id, tags=owner_tags())
    Tracker(TrackingConfig(uri=store_uri, experiment="reliability_touch")).connect()
    status = {run_id: client.get_run(run_id).info.status for run_id in
              (dead.info.run_id, elsewhere.info.run_id, alive.info.run_id)}
    assert list(status.values()) == ["KILLED", "RUNNING", "RUNNING"]
    assert "is gone" in client.get_run(dead.info.run_id).data.tags["qexp.killed_reason"]


def _concurrent_sweeps(store_uri, cache_dir, tmp_path, experiment):
    """4 jobs through joblib (2 workers) and, started at the same moment, a second sweep (basic launcher) that
    shares two of their configs: three processes writing to one store and one cache. Returns both outputs."""
    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir), "MLFLOW_TRACKING_URI": store_uri}
    common = [sys.executable, "-m", "qexp", "-m", *TINY, f"tracking.experiment={experiment}"]
    wide = common + ["quant=fp32,16a8w,8a8w,16a4w", "eval.limit=2", "hydra/launcher=joblib",
                     "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path / 'wide'}"]
    narrow = common + ["quant=16a8w,8a8w", "eval.limit=2", f"hydra.sweep.dir={tmp_path / 'narrow'}"]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in (wide, narrow)]
    return [p.communicate(timeout=1200) + (p.returncode,) for p in procs]


def _check_concurrent(store_uri, cache_dir, experiment, outs):
    from qexp.cache.usage import entries

    for stdout, stderr, code in outs:
        assert code == 0, stderr[-3000:]
        assert "database is locked" not in stderr
    wide, narrow = outs
    assert "4 finished" in wide[0] or "skipped" in wide[0]
    client = MlflowClient(store_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id], max_results=100)
    jobs = [r for r in runs if r.data.tags.get("qexp.role") != "sweep"]
    parents = [r for r in runs if r.data.tags.get("qexp.role") == "sweep"]
    assert len(parents) == 2 and all(r.info.status == "FINISHED" for r in parents)
    hashes = [r.data.tags["config_hash"] for r in jobs]
    assert len(jobs) == 4 and len(set(hashes)) == 4, "a config ran twice"  # the narrow sweep's two were skipped
    assert all(r.info.status == "FINISHED" for r in jobs)
    skipped = sum(int(p.data.metrics["jobs_skipped"]) for p in parents)
    assert skipped == 2
    for entry in entries(cache_dir):  # every cache entry built exactly once, however many jobs read it
        builds = [line for line in (entry.path / ".uses.jsonl").read_text().splitlines() if '"build"' in line]
        assert len(builds) == 1, (entry.kind, entry.key, len(builds))


def test_two_sweeps_at_once_on_the_embedded_store(tmp_path, tmp_path_factory):
    store_uri = f"sqlite:///{tmp_path / 'concurrent.db'}"
    cache_dir = tmp_path_factory.mktemp("concurrent-cache")
    outs = _concurrent_sweeps(store_uri, cache_dir, tmp_path, "concurrent_sqlite")
    _check_concurrent(store_uri, cache_dir, "concurrent_sqlite", outs)


def test_two_sweeps_at_once_on_a_tracking_server(mlflow_server, tmp_path, tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("concurrent-server-cache")
    outs = _concurrent_sweeps(mlflow_server, cache_dir, tmp_path, "concurrent_server")
    _check_concurrent(mlflow_server, cache_dir, "concurrent_server", outs)
