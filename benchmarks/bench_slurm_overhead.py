"""What a sweep job pays for running under SLURM: per job, submission to the run's start, split into SLURM's queue
(sacct Submit -> Start) and the job's start-up (Start -> the MLflow run's start: Python, torch, ExecuTorch, Hydra),
beside a plain `python -m qexp` process's start-up measured in the same run.

Starts the project's single-node SLURM cluster (scripts/services/slurm.sh, as root) in a scratch folder, runs a
4-job sweep of the tiny model with `hydra/launcher=slurm` (2 jobs at a time on this 2-core machine) and stops it.

    .venv/bin/python benchmarks/bench_slurm_overhead.py [--jobs 4]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import pandas as pd

from common import REPO, benchmark_run, write_result

TINY = ["model=tiny", "eval.seq_len=64", "eval.limit=3", "calibration.limit=3"]
QUANTS = ["fp32", "16a8w", "8a8w", "16a4w", "8a4w", "16a16w"]


def _sacct_times(job_id: str, env: dict) -> tuple[float, float]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "Submit,Start"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()[0]
    submit, start = (dt.datetime.fromisoformat(t).timestamp() for t in out.split("|"))
    return submit, start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--store", default=None, help="where to log the benchmark (default: the embedded store)")
    parser.add_argument("--write-results", action="store_true", help="also write results/slurm_overhead.md")
    args = parser.parse_args()
    from mlflow.tracking import MlflowClient

    folder = tempfile.mkdtemp(prefix="qexp-bench-slurm-")
    os.chmod(folder, 0o755)
    env = {**os.environ, "QEXP_SERVICES_DIR": folder}
    script = REPO / "scripts" / "services" / "slurm.sh"
    started = subprocess.run(["bash", str(script), "start"], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        raise SystemExit(f"[bench] no SLURM cluster: {started.stderr.strip()}")
    env["SLURM_CONF"] = started.stdout.strip().splitlines()[-1].split("=", 1)[1]
    store, cache = f"sqlite:///{folder}/store.db", f"{folder}/cache"
    try:
        # a plain process: launch -> its run's start (the cache warmed by a first run, as the sweep's will be)
        for attempt in range(2):
            launched = time.time()
            subprocess.run([sys.executable, "-m", "qexp", *TINY, "quant=fp32", f"cache_dir={cache}",
                            f"tracking.uri={store}", f"tracking.experiment=plain{attempt}"], cwd=REPO, check=True,
                           capture_output=True)
            client = MlflowClient(store)
            (run,) = client.search_runs([client.get_experiment_by_name(f"plain{attempt}").experiment_id])
        plain_startup = run.info.start_time / 1000 - launched
        print(f"[bench] plain python -m qexp: launch to run start {plain_startup:.1f} s", flush=True)

        quants = ",".join(QUANTS[: args.jobs])
        launched = time.time()
        sweep = subprocess.run(
            [sys.executable, "-m", "qexp", "-m", *TINY, f"quant={quants}", "hydra/launcher=slurm",
             "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=3", "hydra.launcher.timeout_min=10",
             f"hydra.sweep.dir={folder}/sweep", f"cache_dir={cache}", f"tracking.uri={store}",
             "tracking.experiment=slurm"], cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.time() - launched
        if sweep.returncode != 0:
            raise SystemExit(f"[bench] the SLURM sweep failed: {sweep.stderr[-2000:]}")
        client = MlflowClient(store)
        runs = [r for r in client.search_runs([client.get_experiment_by_name("slurm").experiment_id])
                if r.data.tags.get("qexp.role") != "sweep"]
        rows = []
        for run in runs:
            submit, start = _sacct_times(run.data.tags["qexp.slurm_job_id"], env)
            run_start = run.info.start_time / 1000
            rows.append({"job": run.data.tags["qexp.slurm_job_id"], "quant": run.data.params["quant.name"],
                         "queue_s": round(start - submit, 1), "startup_s": round(run_start - start, 1),
                         "submit_to_run_s": round(run_start - submit, 1),
                         "run_s": round((run.info.end_time - run.info.start_time) / 1000, 1)})
        table = pd.DataFrame(rows).sort_values("job")
        print(table.to_string(index=False))
        median_startup = statistics.median(table["startup_s"])
        print(f"[bench] {len(rows)} SLURM jobs (2 at a time), sweep wall {wall:.0f} s: submission to run start median "
              f"{statistics.median(table['submit_to_run_s']):.1f} s (queue {statistics.median(table['queue_s']):.1f} s"
              f", start-up {median_startup:.1f} s); a plain process's start-up {plain_startup:.1f} s: "
              f"{median_startup / plain_startup:.2f}x", flush=True)
    finally:
        subprocess.run(["bash", str(script), "stop"], env=env, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
    from qexp.tracking.address import embedded_store_uri

    with benchmark_run(args.store or embedded_store_uri(), "slurm_overhead", "slurm_overhead", {"jobs": args.jobs}):
        import mlflow

        mlflow.log_metrics({"plain_startup_s": round(plain_startup, 1), "sweep_wall_s": round(wall, 1),
                            "median_queue_s": statistics.median(table["queue_s"]),
                            "median_startup_s": median_startup,
                            "median_submit_to_run_s": statistics.median(table["submit_to_run_s"])})
        mlflow.log_text(table.to_csv(index=False), "slurm_overhead.csv")
    if args.write_results:
        write_result("slurm_overhead", table, " ".join(["benchmarks/bench_slurm_overhead.py", *sys.argv[1:]]),
                     notes(plain_startup))


def notes(plain_startup: float) -> list:
    return ["queue_s: sacct Submit -> Start (SLURM's scheduling, and waiting for a free slot: 2 jobs at a time on 2 "
            "cores); startup_s: Start -> the MLflow run's start (Python, torch, ExecuTorch, Hydra, the store); "
            "run_s: the run itself (tiny model, 3 windows).",
            f"A plain `python -m qexp` process, launch -> run start, in the same benchmark run: {plain_startup:.1f} s.",
            "Single-node cluster from scripts/services/slurm.sh (slurm-wlm 22.05, sched_interval=2)."]


if __name__ == "__main__":
    main()
