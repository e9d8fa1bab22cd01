"""Benchmark the sensitivity analysis (`python -m qexp.sensitivity`) cold (empty cache) and warm (the table cached),
in one invocation on the same machine; the project's target for SmolLM2 on a 2-core box is <= 15 minutes cold.

Each run is a subprocess on its own fresh cache directory (cold) and then again on it (warm); printed: wall time of
each, the analysis' own measuring time (`analysis_s`), its cost per group and view, and whether both runs give the
same table (they must). Logged as one run of the MLflow experiment `benchmarks`.

    .venv/bin/python benchmarks/bench_sensitivity.py                                  # SmolLM2, LPBQ-32 vs 8-bit
    .venv/bin/python benchmarks/bench_sensitivity.py model=tiny sensitivity.selection.seq_len=32   # a quick check
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402
from qexp.tracking.address import embedded_store_uri  # noqa: E402

DEFAULT_ARGS = ["quant=16a4w_block", "quant.block_size=32"]
TARGET_COLD_S = 15 * 60.0


def analysis(label: str, args: list, cache: str, store: str) -> tuple[float, str]:
    print(f"[bench] {label}: python -m qexp.sensitivity {' '.join(args)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qexp.sensitivity", *args, "tracking.experiment=benchmarks_runs",
                           "sensitivity.budgets=[]"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "QEXP_CACHE_DIR": cache, "MLFLOW_TRACKING_URI": store})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"[bench] {label} failed (exit {proc.returncode})")
    run_id = next(line.split()[3] for line in proc.stdout.splitlines() if line.startswith("qexp: sensitivity run"))
    print(f"[bench] {label}: {wall:.1f} s (run {run_id})", flush=True)
    return wall, run_id


def main() -> None:
    args = sys.argv[1:] or DEFAULT_ARGS
    store = embedded_store_uri()
    client = MlflowClient(store)
    with tempfile.TemporaryDirectory(prefix="qexp-bench-sensitivity-") as cache:
        cold_s, cold_id = analysis("cold", args, cache, store)
        warm_s, warm_id = analysis("warm", args, cache, store)
    cold, warm = client.get_run(cold_id), client.get_run(warm_id)
    measured = cold.data.metrics["analysis_s"]
    tables = [Path(client.download_artifacts(i, "sensitivity/sensitivity.csv")).read_text() for i in (cold_id, warm_id)]
    n_groups = len(tables[0].splitlines()) - 1
    views = 2 if "spearman_cost_vs_gain" in cold.data.metrics else 1
    same = tables[0] == tables[1]
    print(f"cold: {cold_s:.0f} s wall, of which measuring {measured:.0f} s ({n_groups} groups x {views} view(s): "
          f"{measured / (n_groups * views):.2f} s per group and view); target <= {TARGET_COLD_S:.0f} s: "
          f"ratio {cold_s / TARGET_COLD_S:.2f}")
    print(f"warm: {warm_s:.0f} s wall (cache hit: {warm.data.tags.get('sensitivity_cache_hit')}); warm / cold "
          f"{warm_s / cold_s:.2f}; same table: {same}")
    with benchmark_run(store, "sensitivity", "sensitivity", {"args": " ".join(args)}):
        mlflow.log_metrics({"cold_s": cold_s, "warm_s": warm_s, "analysis_s": measured,
                            "ratio_to_target": cold_s / TARGET_COLD_S, "same_table": float(same)})
    if not same:
        raise SystemExit("[bench] the warm run's table differs from the cold run's")


if __name__ == "__main__":
    main()
