"""How many parallel writers the embedded sqlite MLflow store sustains, and what a writer sees when it does not.

Each writer process logs what one qexp run logs, in the same calls (start a run, ~150 params in batches of 100,
~40 tags, ~60 metrics, two text artifacts, end the run), `--runs` times. Writers start together against a fresh store.
Per writer count: runs landed, failed writers and their first error line, wall time.

    .venv/bin/python benchmarks/bench_store_writers.py --writers 2,4,8,16,32 --runs 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
import traceback
from pathlib import Path

import pandas as pd

from common import benchmark_run


def _writer(uri: str, runs: int, start_at: float, out: mp.Queue) -> None:
    try:
        import mlflow
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        experiment_id = client.get_experiment_by_name("writers").experiment_id
        while time.time() < start_at:  # every writer begins at the same moment
            time.sleep(0.001)
        for i in range(runs):
            run = client.create_run(experiment_id, tags={f"tag{k}": "x" * 20 for k in range(40)})
            run_id = run.info.run_id
            params = [mlflow.entities.Param(f"group{k // 20}.key{k}", str(k)) for k in range(150)]
            for start in range(0, len(params), 100):
                client.log_batch(run_id, params=params[start : start + 100])
            now = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[mlflow.entities.Metric(f"m{k}", k * 0.1, now, 0) for k in range(60)])
            client.log_text(run_id, "config: x\n" * 200, "config.yaml")
            client.log_text(run_id, "log line\n" * 2000, "run.log")
            client.set_terminated(run_id, "FINISHED")
        out.put(("ok", ""))
    except Exception as exc:  # noqa: BLE001 - what the user would see is the point of the measurement
        out.put(("failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                 traceback.format_exc(limit=2)[-500:]))


def measure(writers: int, runs: int) -> dict:
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{Path(tmp) / 'store.db'}"
        client = MlflowClient(uri)
        client.create_experiment("writers", artifact_location=(Path(tmp) / "artifacts").as_uri())
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        start_at = time.time() + 3 + 0.2 * writers  # time for every process to import mlflow
        procs = [ctx.Process(target=_writer, args=(uri, runs, start_at, out)) for _ in range(writers)]
        for p in procs:
            p.start()
        results = [out.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join()
        wall = time.time() - start_at
        landed = len(client.search_runs([client.get_experiment_by_name("writers").experiment_id],
                                        filter_string="attributes.status = 'FINISHED'", max_results=5000))
    failures = [r[1] for r in results if r[0] == "failed"]
    return {"writers": writers, "runs_expected": writers * runs, "runs_finished": landed,
            "failed_writers": len(failures), "wall_s": round(wall, 1),
            "first_error": failures[0] if failures else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", default="2,4,8,16,32")
    parser.add_argument("--runs", type=int, default=5, help="runs per writer")
    parser.add_argument("--store", default=None, help="where to log the benchmark (default: the embedded store)")
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.writers.split(",")):
        row = measure(n, args.runs)
        rows.append(row)
        print(f"[bench] {n} writers: {row['runs_finished']}/{row['runs_expected']} runs, "
              f"{row['failed_writers']} writers failed, {row['wall_s']} s {row['first_error']}", flush=True)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    from qexp.tracking.store import embedded_store_uri

    with benchmark_run(args.store or embedded_store_uri(), "store_writers", "store_writers",
                       {"store": "sqlite (embedded)"}):
        import mlflow

        for row in rows:
            mlflow.log_metrics({f"runs_finished_{row['writers']}w": row["runs_finished"],
                                f"failed_writers_{row['writers']}w": row["failed_writers"],
                                f"wall_s_{row['writers']}w": row["wall_s"]})
        mlflow.log_text(table.to_csv(index=False), "store_writers.csv")


if __name__ == "__main__":
    main()
