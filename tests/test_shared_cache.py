"""A cache folder shared by concurrent jobs (on one host or many, e.g. over NFS): an entry is built once while the
others wait for it and reuse it; a builder killed mid-build leaves nothing that looks valid and its lock is taken
over; a lock held too long fails saying who holds it; a cache_dir that cannot be written is refused before work."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, TINY
from qexp.cache import USES, Cache, lock_path
from qexp.cache.lock import EntryLock
from qexp.core.errors import CacheLockError

SPAWN = mp.get_context("spawn")  # fresh interpreters: no lock state or threads inherited from pytest


def _build_slowly(root: str, count_file: str, started_file: str, seconds: float, out) -> None:
    def build(tmp: Path) -> dict:
        Path(started_file).touch()
        with open(count_file, "a") as handle:  # one line per build actually run
            handle.write(f"{os.getpid()}\n")
        time.sleep(seconds)
        (tmp / "data.bin").write_bytes(os.urandom(1024))
        return {"builder": os.getpid()}

    path, hit = Cache(root).get_or_build("qdq", "samekey", build)
    if out is not None:
        out.put((hit, (path / "data.bin").read_bytes()))


def test_concurrent_jobs_build_an_entry_once_and_share_it(tmp_path):
    count, started, out = tmp_path / "builds", tmp_path / "started", SPAWN.Queue()
    procs = [SPAWN.Process(target=_build_slowly, args=(str(tmp_path / "cache"), str(count), str(started), 3.0, out))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert count.read_text().count("\n") == 1  # built once
    assert sorted(hit for hit, _ in results) == [False, True, True, True]
    assert len({data for _, data in results}) == 1  # every job reads the one entry
    events = [json.loads(line)["event"] for line in (tmp_path / "cache/qdq/samekey" / USES).read_text().splitlines()]
    assert events.count("build") == 1 and events.count("hit") == 3
    assert not lock_path(tmp_path / "cache/qdq", "samekey").exists()  # released


def test_a_killed_builder_leaves_no_valid_entry_and_the_next_job_takes_over(tmp_path, caplog):
    root, count, started = tmp_path / "cache", tmp_path / "builds", tmp_path / "started"
    builder = SPAWN.Process(target=_build_slowly, args=(str(root), str(count), str(started), 600.0, None))
    builder.start()
    deadline = time.time() + 60
    while not started.exists():
        assert time.time() < deadline and builder.is_alive(), "the builder never started building"
        time.sleep(0.1)
    holder = json.loads(lock_path(root / "qdq", "samekey").read_text())
    assert holder["pid"] == builder.pid and holder["host"]  # the lock says who builds
    os.kill(builder.pid, signal.SIGKILL)
    builder.join()
    cache = Cache(root)
    assert not cache.has("qdq", "samekey")  # the half-built copy is not an entry
    assert lock_path(root / "qdq", "samekey").exists()  # the dead builder's lock is left behind ...
    began = time.time()
    with caplog.at_level(logging.WARNING, logger="qexp"):
        _build_slowly(str(root), str(count), str(started), 0.0, None)
    assert time.time() - began < 10  # ... and taken over at once (same host, its process is gone)
    assert "which is gone: lock taken over" in caplog.text and f"pid {builder.pid}" in caplog.text
    assert count.read_text().count("\n") == 2 and cache.has("qdq", "samekey")


def _foreign_lock(path: Path, age_s: float) -> None:
    """A lock file as a job on another host of the shared folder writes it, last heartbeat `age_s` ago."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "start": "1", "token": "t", "since": 0}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_a_lock_from_another_host_is_honoured_while_it_beats_and_taken_over_when_it_stops(tmp_path, caplog):
    root = tmp_path / "cache"
    _foreign_lock(lock_path(root / "qdq", "k"), age_s=1)  # a live build elsewhere
    with pytest.raises(CacheLockError) as failure:
        Cache(root, lock_timeout_s=1.5).get_or_build("qdq", "k", lambda tmp: None)
    assert "held by host node-elsewhere pid 4242" in str(failure.value)
    assert "cache.lock_timeout_s" in str(failure.value) and str(lock_path(root / "qdq", "k")) in str(failure.value)
    _foreign_lock(lock_path(root / "qdq", "k"), age_s=600)  # its heartbeat stopped long ago: that host is gone
    with caplog.at_level(logging.WARNING, logger="qexp"):
        _, hit = Cache(root, lock_timeout_s=5).get_or_build("qdq", "k", lambda tmp: None)
    assert not hit and "node-elsewhere" in caplog.text


def test_a_held_lock_keeps_beating(tmp_path):
    lock = EntryLock(tmp_path / ".k.lockfile", "test entry", heartbeat_s=0.2)
    with lock:
        first = lock.path.stat().st_mtime
        time.sleep(1.0)
        assert lock.path.stat().st_mtime > first
        other = EntryLock(tmp_path / ".k.lockfile", "test entry", stale_after_s=0.5)
        assert other.held() is not None and not other.acquire(blocking=False)  # fresh: not stale to anyone
    assert not lock.path.exists()


def test_an_unwritable_cache_dir_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    began = time.time()
    done = subprocess.run([sys.executable, "-m", "qexp", *TINY, f"cache_dir={blocker}/cache",
                           f"tracking.uri=sqlite:///{tmp_path}/store.db"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "qexp" in line or "Error" in line]  # not MLflow's store setup
    assert len(lines) == 1 and f"cache_dir={blocker}/cache cannot be used" in lines[0], done.stderr
    assert "Not a directory" in lines[0] and "QEXP_CACHE_DIR" in lines[0]
    assert time.time() - began < 120


def test_four_jobs_on_one_cache_folder_calibrate_once_and_agree(tmp_path):
    """Four runs of one quantized config started together (separate experiments, so none skips another) on one
    cache folder: every cache entry (model, text, FP evaluation, QDQ statistics) is built by one of them and reused
    by the others, and all four log the same numbers."""
    import mlflow

    from qexp.cache.usage import entries

    cache, store = tmp_path / "cache", f"sqlite:///{tmp_path}/store.db"
    subprocess.run([sys.executable, "-c", f"import mlflow; mlflow.MlflowClient('{store}').search_experiments()"],
                   check=True, capture_output=True)  # the store's tables, before four processes race to create them
    jobs = [subprocess.Popen([sys.executable, "-m", "qexp", *TINY, "quant=16a8w", f"cache_dir={cache}",
                              f"tracking.uri={store}", f"tracking.experiment=shared{i}"],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in range(4)]
    for job in jobs:
        _, err = job.communicate(timeout=900)
        assert job.returncode == 0, err[-2000:]
    built = {}
    for entry in entries(cache):
        events = [json.loads(line)["event"] for line in (entry.path / USES).read_text().splitlines()]
        built[f"{entry.kind}/{entry.key}"] = events.count("build")
    assert any(name.startswith("qdq/") for name in built) and set(built.values()) == {1}, built
    client = mlflow.MlflowClient(store)
    metrics = []
    for i in range(4):
        (run,) = client.search_runs([client.get_experiment_by_name(f"shared{i}").experiment_id])
        assert run.info.status == "FINISHED"
        metrics.append({k: v for k, v in run.data.metrics.items() if k.startswith("ppl")})
    assert metrics[0] and all(m == metrics[0] for m in metrics), metrics
