"""How many parallel writers an MLflow store sustains, and what a writer sees when it does not: the embedded sqlite
file beside a team server on PostgreSQL (scripts/services/mlflow_server.sh: served artifacts), in one run.

Each writer (a thread with its own client, 8 to a process: memory) logs what one qexp run logs, in the same calls
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
import subprocess
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pandas as pd

from common import REPO, benchmark_run


METRICS_PER_RUN = 60
THREADS_PER_PROCESS = 8  # 128 writer processes would need ~22 GiB here (175 MiB each with mlflow imported)


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


def _writer_process(uri: str, experiment: str, threads: int, runs: int, ready, out: mp.Queue) -> None:
    """`threads` writers, each its own client (its own connections), released together with every other process's."""
    from mlflow.tracking import MlflowClient

    clients = [MlflowClient(uri) for _ in range(threads)]
    experiment_id = clients[0].get_experiment_by_name(experiment).experiment_id
    ready.wait()  # every writer of every process begins at the same moment

    def write(client) -> None:
        try:
            _write_runs(client, experiment_id, runs)
            out.put(("ok", ""))
        except Exception as exc:  # noqa: BLE001 - what the user would see is the point of the measurement
            out.put(("failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                     traceback.format_exc(limit=2)[-500:]))

    workers = [threading.Thread(target=write, args=(client,)) for client in clients]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def measure(store: str, writers: int, runs: int, server_url: str | None) -> dict:
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        if store == "sqlite":
            uri = f"sqlite:///{Path(tmp) / 'store.db'}"
            client = MlflowClient(uri)
            client.create_experiment("writers", artifact_location=(Path(tmp) / "artifacts").as_uri())
        else:  # one experiment per measurement on the server, created before the writers start (mlflow#4123)
            uri, client = server_url, MlflowClient(server_url)
            name = f"writers-{writers}w-{time.time_ns()}"
            client.create_experiment(name)
        experiment = "writers" if store == "sqlite" else name
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        counts = [THREADS_PER_PROCESS] * (writers // THREADS_PER_PROCESS) + [writers % THREADS_PER_PROCESS]
        counts = [c for c in counts if c]
        ready = ctx.Barrier(len(counts) + 1)
        procs = [ctx.Process(target=_writer_process, args=(uri, experiment, c, runs, ready, out)) for c in counts]
        for p in procs:
            p.start()
        ready.wait(timeout=600)
        start = time.time()
        results = [out.get(timeout=1800) for _ in range(writers)]
        wall = time.time() - start
        for p in procs:
            p.join()
        landed = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                                    filter_string="attributes.status = 'FINISHED'", max_results=5000)
        metrics = sum(len(run.data.metrics) for run in landed)
    failures = [r[1] for r in results if r[0] == "failed"]
    return {"store": store, "writers": writers, "runs_expected": writers * runs, "runs_finished": len(landed),
            "metrics_expected": writers * runs * METRICS_PER_RUN, "metrics_landed": metrics,
            "failed_writers": len(failures), "wall_s": round(wall, 1),
            "runs_per_s": round(len(landed) / wall, 2) if wall > 0 else None,
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
    try:
        yield started.stdout.strip().splitlines()[-1]
    finally:
        for script in ("mlflow_server.sh", "postgres.sh"):
            subprocess.run(["bash", str(scripts / script), "stop"], env=env, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", default="8,64,128")
    parser.add_argument("--runs", type=int, default=3, help="runs per writer")
    parser.add_argument("--stores", default="sqlite,postgresql", help="sqlite and/or postgresql")
    parser.add_argument("--store", default=None, help="where to log the benchmark (default: the embedded store)")
    args = parser.parse_args()
    stores = args.stores.split(",")
    rows = []
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
    from qexp.tracking.store import embedded_store_uri

    with benchmark_run(args.store or embedded_store_uri(), "store_writers", "store_writers",
                       {"stores": ",".join(stores)}):
        import mlflow

        for row in rows:
            mlflow.log_metrics({f"{row['store']}_runs_finished_{row['writers']}w": row["runs_finished"],
                                f"{row['store']}_metrics_landed_{row['writers']}w": row["metrics_landed"],
                                f"{row['store']}_failed_writers_{row['writers']}w": row["failed_writers"],
                                f"{row['store']}_wall_s_{row['writers']}w": row["wall_s"]})
        mlflow.log_text(table.to_csv(index=False), "store_writers.csv")


if __name__ == "__main__":
    main()
