"""Fault injection: each fault ends in one clear line, a non-zero exit and a FAILED (or KILLED) run with the
reason, loses no finished run, and leaves nothing half-written that looks valid. The other faults of the suite live
beside the features they test: a failing job mid-sweep (test_sweep: the poisoned job), SIGKILL mid-sweep
(test_reliability), truncated and corrupt cache entries of every kind (test_cache), an unreachable server at start
(test_sweep, test_tracking); a store that goes away mid-run (below)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import REPO, TINY

pytestmark = pytest.mark.slow


def _qexp(args, cache_dir, store_uri, **kwargs):
    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir), "MLFLOW_TRACKING_URI": store_uri}
    return subprocess.run([sys.executable, "-m", "qexp", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900, **kwargs)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB filesystem (tmpfs; needs root) or, where mounting is not allowed, a 2 MiB file size limit."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0
    if mounted:
        yield mount, None
        subprocess.run(["umount", str(mount)], check=False)
        return

    def limit():  # write() then fails with EFBIG instead of killing the process with SIGXFSZ
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))

    yield mount, limit


def test_full_disk_during_a_cache_write(small_disk, store_uri, tmp_path):
    """The parsed text entry (~3 MB) does not fit: the run fails in one line naming the cache, is FAILED in the
    store with the reason, and the cache holds no entry, complete-looking or not. With room, the same run works."""
    cache_dir, preexec = small_disk
    args = [*TINY, "quant=fp32", "tracking.experiment=faults_disk"]
    out = _qexp(args, cache_dir, store_uri, preexec_fn=preexec)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("qexp: error:")]
    assert len(errors) == 1 and "no room to write the" in errors[0] and "cache entry" in errors[0], out.stderr[-2000:]
    client = MlflowClient(store_uri)
    run = client.search_runs([client.get_experiment_by_name("faults_disk").experiment_id])[0]
    assert run.info.status == "FAILED" and "no room" in run.data.tags["error"]
    from qexp.cache import damage

    kind_dirs = [p for p in Path(cache_dir).iterdir() if p.is_dir()]
    entry_dirs = [p for kind in kind_dirs for p in kind.iterdir() if p.is_dir()]
    assert not [p for p in entry_dirs if p.name.startswith(".")]  # no temporary build directory left
    for entry in entry_dirs:  # what is there (the small tiny-model entry fits) is complete and whole
        assert (entry / ".complete").exists() and damage(entry) is None, entry
    assert not (Path(cache_dir) / "text").exists() or not [p for p in (Path(cache_dir) / "text").iterdir()
                                                           if p.is_dir()]
    roomy = tmp_path / "roomy"
    assert _qexp(args, roomy, store_uri).returncode == 0


class _Server:
    """An MLflow server on a sqlite file that a test can kill and start again on the same port and data."""

    def __init__(self, tmp_path: Path):
        from helpers import free_port

        port = free_port()
        self.cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                    "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--serve-artifacts",
                    "--artifacts-destination", str(tmp_path / "art"), "--workers", "1"]
        self.uri, self.proc = f"http://127.0.0.1:{port}", None

    def start(self) -> "_Server":
        from helpers import wait_until_healthy

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True,  # no GenAI job consumers (25 processes) on 2 cores
                                     env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        wait_until_healthy(self.uri, self.proc, "mlflow server")
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers, at once
        self.proc.wait()


def _jobs(uri: str, experiment: str):
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return [r for r in runs if r.data.tags.get("qexp.role") != "sweep"]


def _record(uri: str, run) -> tuple:
    """What a run holds: its status and the names of its params, metrics, tags and artifacts."""
    client = MlflowClient(uri)
    artifacts, folders = set(), [""]
    while folders:
        for item in client.list_artifacts(run.info.run_id, folders.pop() or None):
            (folders.append(item.path) if item.is_dir else artifacts.add(item.path))
    tags = {k for k in run.data.tags if not k.startswith("mlflow.")} - {"qexp.pid", "qexp.started_at"}
    metrics = {k for k in run.data.metrics if not k.startswith("time_")}  # a stage timed only when not cached
    return run.info.status, set(run.data.params), metrics, tags, artifacts


def test_a_sweep_rides_out_its_server_restarting(tmp_path, cache_dir):
    """The server is killed as the first of three jobs finishes and started again (a restart, ~10-20 s here): the
    jobs wait for it, and every run finishes with all its params, metrics, tags and artifacts; the sweep exits 0."""
    server = _Server(tmp_path).start()
    args = ["-m", *TINY, "quant=16a8w", "eval.limit=2,3,4", "tracking.experiment=faults_server",  # alike runs
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir), "MLFLOW_TRACKING_URI": server.uri}
    sweep = subprocess.Popen([sys.executable, "-m", "qexp", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while len(_jobs(server.uri, "faults_server")) < 2 and time.time() < deadline:  # the second job's run began
            time.sleep(0.2)
        server.kill()
        time.sleep(3)
        server.start()
        stdout, stderr = sweep.communicate(timeout=900)
    finally:
        sweep.kill()
        server.kill()
    assert sweep.returncode == 0, stderr[-3000:]
    summary = [line for line in stdout.splitlines() if "jobs):" in line]
    assert summary and "3 finished, 0 failed" in summary[0], stdout[-3000:]
    assert "answers again" in stdout + stderr, [line for line in (stdout + stderr).splitlines() if "store" in line]
    server.start()
    try:
        records = [_record(server.uri, run) for run in _jobs(server.uri, "faults_server")]
    finally:
        server.kill()
    assert len(records) == 3 and all(r[0] == "FINISHED" for r in records)
    differences = [[sorted(a ^ b) for a, b in zip(r[1:], records[0][1:])] for r in records[1:]]
    assert {"config.yaml", "run.log"} <= records[0][4] and not any(any(d) for d in differences), differences


def test_a_run_outlasting_its_stores_outage_keeps_its_record_in_a_spool(tmp_path, cache_dir):
    """Past tracking.outage_s the run goes on, its record goes to a spool and it ends with one line naming it;
    `python -m qexp.store replay` uploads it once the server is back: the same params, metrics, tags and artifacts
    as the same run made with the server up, FINISHED."""
    server = _Server(tmp_path).start()
    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir), "MLFLOW_TRACKING_URI": server.uri}
    run = [sys.executable, "-m", "qexp", *TINY, "quant=16a8w", "tracking.experiment=faults_spool",
           "tracking.outage_s=2", f"tracking.spool_dir={tmp_path / 'spool'}"]
    try:
        reference = subprocess.run(run, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert reference.returncode == 0, reference.stderr[-3000:]
        spooled = subprocess.Popen(run, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while len(_jobs(server.uri, "faults_spool")) < 2 and time.time() < deadline:  # its run has started
            time.sleep(0.2)
        server.kill()
        _, stderr = spooled.communicate(timeout=900)
        errors = [line for line in stderr.splitlines() if line.startswith("qexp: error:")]
        assert spooled.returncode != 0 and len(errors) == 1, stderr[-3000:]
        assert "spooled in" in errors[0] and "python -m qexp.store replay" in errors[0], errors
        [folder] = list((tmp_path / "spool").iterdir())
        server.start()
        replay = subprocess.run([sys.executable, "-m", "qexp.store", "replay", str(tmp_path / "spool")], cwd=REPO,
                                env=env, capture_output=True, text=True, timeout=300)
        assert replay.returncode == 0 and f"replayed run {folder.name}" in replay.stdout, replay.stderr[-2000:]
        assert folder.with_name(folder.name + ".replayed").is_dir()
        runs = {run.info.run_id: _record(server.uri, run) for run in _jobs(server.uri, "faults_spool")}
        again = subprocess.run([sys.executable, "-m", "qexp.store", "replay", str(tmp_path / "spool")], cwd=REPO,
                               env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and "nothing to replay" in again.stdout
    finally:
        server.kill()
    restored = runs.pop(folder.name)
    [made_live] = runs.values()
    assert restored == made_live and restored[0] == "FINISHED", (restored, made_live)
