"""How many parallel writers an MLflow store sustains, and what a writer sees when it does not: the embedded sqlite
file beside a team server on PostgreSQL (scripts/services/mlflow_server.sh: served artifacts), in one run.

Each writer (a process, as each job of a sweep is) logs what one qexp run logs, in the same calls
(start a run, ~150 params in batches of 100, ~40 tags, 60 metrics, two text artifacts, end the run), `--runs` times.
Writers start together against a fresh store (PostgreSQL: a fresh experiment on a server started for the benchmark
in a scratch folder). Per store and writer count: runs landed, metrics landed, failed writers and their first error
line, wall time, runs written per second.

    .venv/bin/python benchmarks/bench_store_writers.py --stores sqlite,postgresql --writers 8,64,128 --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from common import REPO, benchmark_run, write_result


METRICS_PER_RUN = 60
NOTES = ["Each writer is a process logging what one qexp run logs (~150 params, ~40 tags, 60 metrics, two text "
         "artifacts), `runs_expected / writers` runs each, all released at once; runs and metrics counted afterwards.",
         "sqlite: the embedded store's file (MLflow's sqlite backend, 5 s lock timeout). postgresql: "
         "`scripts/services/mlflow_server.sh` (MLflow server, 4 workers, artifacts served, PostgreSQL 15), on the "
         "same machine.",
         "runs_per_s: FINISHED runs per second of wall time; a ratio between rows holds only within one run of "
         "the benchmark."]


def _write_runs(client, experiment_id: str, runs: int) -> None:
    import mlflow

    for _ in range(runs):
        run = client.create_run(experiment_id, tags={f"tag{k}": "x" * 20 for k in range(40)})
        run_id = run.info.run_id
        params = [mlflow.entities.Param(f"group{k // 20}.key{k}", str(k)) for k in range(150)]
        for start in range(0, len(params), 100):
            client.log_batch(run_id, params=params[start : start + 100])
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[mlflow.entities.Metric(f"m{k}", k * 0.1, now, 0)
                                          for k in range(METRICS_PER_RUN)])
        client.log_text(run_id, "config: x\n" * 200, "config.yaml")
        client.log_text(run_id, "log line\n" * 2000, "run.log")
        client.set_terminated(run_id, "FINISHED")


def _writer(uri: str, experiment: str, runs: int, ready, out) -> None:
    """One writer process (one job), released together with every other."""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        experiment_id = client.get_experiment_by_name(experiment).experiment_id
    except Exception as exc:  # noqa: BLE001
        ready.wait()
        out.put(("failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
        return
    ready.wait()
    try:
        _write_runs(client, experiment_id, runs)
        out.put(("ok", ""))
    except Exception as exc:  # noqa: BLE001 - what the user would see is the point of the measurement
        out.put(("failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))


def _in_child(function, *args):
    """`function(*args)` in a forked child, its result back: the parent never opens a store connection, which its
    forked writers would otherwise share."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=lambda: out.put(function(*args)))
    child.start()
    result = out.get(timeout=600)
    child.join()
    return result


def _create_experiment(uri: str, name: str, artifacts: str | None) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).create_experiment(name, artifact_location=artifacts)


def _count(uri: str, experiment: str) -> tuple[int, int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    landed = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                                filter_string="attributes.status = 'FINISHED'", max_results=5000)
    return len(landed), sum(len(run.data.metrics) for run in landed)


def measure(store: str, writers: int, runs: int, server_url: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        experiment = f"writers-{writers}w-{time.time_ns()}"
        if store == "sqlite":
            uri = f"sqlite:///{Path(tmp) / 'store.db'}"
            _in_child(_create_experiment, uri, experiment, (Path(tmp) / "artifacts").as_uri())
        else:  # created before the writers start (mlflow#4123)
            uri = server_url
            _in_child(_create_experiment, uri, experiment, None)
        # forked after mlflow's import (in main): the writers share its pages, ~20x less memory than spawned ones
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        ready = ctx.Barrier(writers + 1)
        procs = [ctx.Process(target=_writer, args=(uri, experiment, runs, ready, out)) for _ in range(writers)]
        for p in procs:
            p.start()
        ready.wait(timeout=600)
        start = time.time()
        results = [out.get(timeout=1800) for _ in procs]
        wall = time.time() - start
        for p in procs:
            p.join()
        landed, metrics = _in_child(_count, uri, experiment)
    failures = [r[1] for r in results if r[0] == "failed"]
    return {"store": store, "writers": writers, "runs_expected": writers * runs, "runs_finished": landed,
            "metrics_expected": writers * runs * METRICS_PER_RUN, "metrics_landed": metrics,
            "failed_writers": len(failures), "wall_s": round(wall, 1),
            "runs_per_s": round(landed / wall, 2) if wall > 0 else None,
            "first_error": failures[0] if failures else ""}


@contextlib.contextmanager
def postgresql_server():
    """A PostgreSQL-backed MLflow server in a scratch folder, started and stopped by the project's scripts."""
    folder = tempfile.mkdtemp(prefix="qexp-bench-services-")
    os.chmod(folder, 0o755)  # PostgreSQL runs as its own user
    env = {**os.environ, "QEXP_SERVICES_DIR": folder, "QEXP_PG_PORT": "54391", "QEXP_MLFLOW_PORT": "5091",
           "QEXP_MLFLOW_WORKERS": os.environ.get("QEXP_MLFLOW_WORKERS", "4")}
    scripts = REPO / "scripts" / "services"
    started = subprocess.run(["bash", str(scripts / "mlflow_server.sh"), "start"], env=env, capture_output=True,
                             text=True)
    if started.returncode != 0:
        raise SystemExit(f"[bench] no PostgreSQL-backed server: {started.stderr.strip()}")
    # the writers log in as the store's admin (the server asks every request for a login, as a team store does)
    login = {"MLFLOW_TRACKING_USERNAME": "admin",
             "MLFLOW_TRACKING_PASSWORD": (Path(folder) / "mlflow-admin-password").read_text().strip()}
    saved = {k: os.environ.get(k) for k in login}
    os.environ.update(login)
    try:
        yield started.stdout.strip().splitlines()[-1]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for script in ("mlflow_server.sh", "postgres.sh"):
            subprocess.run(["bash", str(scripts / script), "stop"], env=env, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", default="8,64,128")
    parser.add_argument("--runs", type=int, default=3, help="runs per writer")
    parser.add_argument("--stores", default="sqlite,postgresql", help="sqlite and/or postgresql")
    parser.add_argument("--store", default=None, help="where to log the benchmark (default: the embedded store)")
    parser.add_argument("--write-results", action="store_true", help="also write results/store_writers.md")
    args = parser.parse_args()
    stores = args.stores.split(",")
    import qexp  # noqa: F401 - the environment a qexp job logs with (MLflow's telemetry off)
    import mlflow  # noqa: F401 - imported once here, shared by the forked writers
    rows = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed benchmark still stops its server
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(postgresql_server()) if "postgresql" in stores else None
        for n in (int(x) for x in args.writers.split(",")):
            for store in stores:  # side by side at each writer count
                row = measure(store, n, args.runs, server)
                rows.append(row)
                print(f"[bench] {store} {n} writers: {row['runs_finished']}/{row['runs_expected']} runs, "
                      f"{row['metrics_landed']}/{row['metrics_expected']} metrics, {row['failed_writers']} writers "
                      f"failed, {row['wall_s']} s {row['first_error']}", flush=True)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    wide = table.pivot(index="writers", columns="store", values="runs_per_s")
    if {"sqlite", "postgresql"} <= set(wide.columns):
        for n, row in wide.iterrows():
            print(f"[bench] {n} writers: PostgreSQL server / sqlite file, runs written per second: "
                  f"{row['postgresql'] / row['sqlite']:.2f}x")
    from qexp.tracking.address import embedded_store_uri

    with benchmark_run(args.store or embedded_store_uri(), "store_writers", "store_writers",
                       {"stores": ",".join(stores)}):
        import mlflow

        for row in rows:
            mlflow.log_metrics({f"{row['store']}_runs_finished_{row['writers']}w": row["runs_finished"],
                                f"{row['store']}_metrics_landed_{row['writers']}w": row["metrics_landed"],
                                f"{row['store']}_failed_writers_{row['writers']}w": row["failed_writers"],
                                f"{row['store']}_wall_s_{row['writers']}w": row["wall_s"]})
        mlflow.log_text(table.to_csv(index=False), "store_writers.csv")
    if args.write_results:
        write_result("store_writers", table, " ".join(["benchmarks/bench_store_writers.py", *sys.argv[1:]]),
                     NOTES)


if __name__ == "__main__":
    main()
