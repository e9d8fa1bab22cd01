"""Fault injection: each fault ends in one clear line, a non-zero exit and a FAILED (or KILLED) run with the
reason, loses no finished run, and leaves nothing half-written that looks valid. The other faults of the suite live
beside the features they test: a failing job mid-sweep (test_sweep: the poisoned job), SIGKILL mid-sweep
(test_reliability), truncated and corrupt cache entries of every kind (test_cache), an unreachable server at start
(test_sweep, test_tracking)."""

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


def test_tracking_server_dies_mid_sweep(tmp_path, cache_dir):
    """The server goes away after the first job: the next jobs fail with one line each, the sweep exits non-zero,
    the finished job stays in the store, and once the server is back a re-run does only the missing jobs."""
    from helpers import free_port, wait_until_healthy

    port = free_port()
    server_cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                  "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--default-artifact-root",
                  str(tmp_path / "art"), "--workers", "1"]
    uri = f"http://127.0.0.1:{port}"

    def start_server():
        proc = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True,  # no GenAI job consumers (25 processes) on 2 cores
                                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        wait_until_healthy(uri, proc, "mlflow server")
        return proc

    server = start_server()
    args = ["-m", *TINY, "quant=fp32,16a8w,8a8w", "tracking.experiment=faults_server",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir), "MLFLOW_TRACKING_URI": uri}
    sweep = subprocess.Popen([sys.executable, "-m", "qexp", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while not list((tmp_path / "sweep").glob("*/qexp_job.json")) and time.time() < deadline:
            time.sleep(0.2)
        os.killpg(server.pid, signal.SIGKILL)  # the first job has finished: the server dies
        server.wait()
        stdout, stderr = sweep.communicate(timeout=900)
    finally:
        sweep.kill()
    assert sweep.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith(("qexp: error:", "qexp: failed"))]
    print("\n".join(errors))  # shown with -s: what the user sees
    assert errors and all(len(line) < 1000 for line in errors), stderr[-3000:]
    assert any("unreachable" in line or "MLflow" in line for line in errors), errors

    server = start_server()
    try:
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("faults_server").experiment_id])
        finished = [r for r in runs if r.info.status == "FINISHED" and r.data.tags.get("qexp.role") != "sweep"]
        assert len(finished) >= 1  # the job that finished before the server died is kept
        rerun = subprocess.run([sys.executable, "-m", "qexp", *args[:-1], f"hydra.sweep.dir={tmp_path / 'rerun'}"],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert f"{len(finished)} skipped" in rerun.stdout
        runs = client.search_runs([client.get_experiment_by_name("faults_server").experiment_id])
        jobs = [r for r in runs if r.info.status == "FINISHED" and r.data.tags.get("qexp.role") != "sweep"]
        assert len({r.data.tags["config_hash"] for r in jobs}) == 3
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
