"""What the benchmark scripts share: running `python -m qexp` as a subprocess, timed, against one MLflow store, and
logging a benchmark's figures as one run of the MLflow experiment `benchmarks`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def machine_used_mib() -> float:
    """Memory in use on the whole machine (MiB): MemTotal - MemAvailable from /proc/meminfo.

    Its rise over a run is the process tree's physical memory with each page counted once (a forked worker's
    copy-on-write pages shared with its parent count once, where summed RSS counts them twice), plus whatever else
    the machine did meanwhile (nothing else runs during a benchmark; reclaimable page cache is not counted). Cheap to
    read, unlike PSS (/proc/PID/smaps_rollup), whose sampling slowed the runs it measured."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0])
    return (fields["MemTotal"] - fields["MemAvailable"]) / 1024


def run_qexp(label: str, args: list[str], store: str) -> tuple[float, subprocess.CompletedProcess]:
    """Run `python -m qexp ARGS` logging into `store`; return (wall seconds, the process). Exits on failure."""
    print(f"[bench] {label}: python -m qexp {' '.join(args)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qexp", *args], cwd=REPO,
                          env={**os.environ, "MLFLOW_TRACKING_URI": store}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"[bench] {label} failed (exit {proc.returncode})")
    print(f"[bench] {label}: {wall:.1f} s", flush=True)
    return wall, proc


@contextmanager
def benchmark_run(store: str, run_name: str, benchmark: str, tags: dict):
    """An MLflow run in experiment `benchmarks` of `store`, tagged benchmark=<name> and `tags`."""
    import mlflow

    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("benchmarks")
    with mlflow.start_run(run_name=run_name) as run:
        mlflow.set_tags({"benchmark": benchmark, **tags})
        yield run
