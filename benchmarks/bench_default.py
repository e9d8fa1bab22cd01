"""Benchmark the default experiment cold (empty cache) and warm (cached fp32 model and QDQ program).

Both runs are subprocesses of `python -m qexp +experiment=16a4w_wikitext`, side by side in one invocation, so the
figures share the machine's state. Prints per-stage times, wall time and peak RSS, the ratios to the targets for the
phases that ran, and logs them as an MLflow run in the `benchmarks` experiment of the same store. Targets on a
2-core box: FP+QDQ phases (backend=none) under 5 min cold, 2 min warm, 6 GiB; with the HTP phase (the default
experiment: compile + x86 emulator) under 15 min cold, 4 min warm (compile cache hit), 10 GiB.

    .venv/bin/python benchmarks/bench_default.py                 # the default experiment, all phases
    .venv/bin/python benchmarks/bench_default.py backend=none    # FP + QDQ phases only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run, run_qexp  # noqa: E402
from qexp.tracking.store import embedded_store_uri  # noqa: E402

TARGETS = {
    "cpu_phases": {"cold_s": 300.0, "warm_s": 120.0, "peak_rss_mb": 6 * 1024.0},
    "with_htp": {"cold_s": 900.0, "warm_s": 240.0, "peak_rss_mb": 10 * 1024.0},
}


def run_once(label: str, experiment: str, cache_dir: str, store: str, extra: list[str]) -> dict:
    wall, proc = run_qexp(label, [f"+experiment={experiment}", f"cache_dir={cache_dir}", "tracking.experiment=benchmarks",
                                  f"tracking.run_name=bench-{label}", *extra], store)
    run_id = next(line.split()[2] for line in proc.stdout.splitlines() if line.startswith("qexp: run "))
    metrics = MlflowClient(store).get_run(run_id).data.metrics
    return {"label": label, "run_id": run_id, "wall_s": wall, **metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="16a4w_wikitext")
    parser.add_argument("--store", default=os.environ.get("MLFLOW_TRACKING_URI") or embedded_store_uri())
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="qexp-bench-cache-") as cache_dir:
        cold = run_once("cold", args.experiment, cache_dir, args.store, args.overrides)
        warm = run_once("warm", args.experiment, cache_dir, args.store, args.overrides)

    stages = sorted(k for k in set(cold) | set(warm) if k.startswith("time_"))
    table = pd.DataFrame(
        {"cold": [cold.get(s) for s in stages], "warm": [warm.get(s) for s in stages]},
        index=[s[len("time_"):-2] for s in stages],
    )
    table.loc["wall (process)"] = [cold["wall_s"], warm["wall_s"]]
    table.loc["peak RSS MiB"] = [cold["peak_rss_mb"], warm["peak_rss_mb"]]
    print("\nper-stage seconds (nested stages: export/prepare/calibrate/convert/save_qdq are inside quantize)")
    print(table.round(1).to_string())

    phases = "with_htp" if "ppl_deployed" in cold else "cpu_phases"
    targets = TARGETS[phases]
    summary = {
        "cold_wall_s": cold["wall_s"],
        "warm_wall_s": warm["wall_s"],
        "cold_vs_target": cold["wall_s"] / targets["cold_s"],
        "warm_vs_target": warm["wall_s"] / targets["warm_s"],
        "warm_vs_cold": warm["wall_s"] / cold["wall_s"],
        "peak_rss_mb": max(cold["peak_rss_mb"], warm["peak_rss_mb"]),
        "peak_rss_vs_target": max(cold["peak_rss_mb"], warm["peak_rss_mb"]) / targets["peak_rss_mb"],
    }
    print(f"\nratios to the {phases} targets {targets} (< 1.0 meets the target):")
    for key in ("cold_vs_target", "warm_vs_target", "peak_rss_vs_target", "warm_vs_cold"):
        print(f"  {key:20s} {summary[key]:.3f}")

    with benchmark_run(args.store, f"bench_default-{args.experiment}", "bench_default", {
        "cold_run": cold["run_id"], "warm_run": warm["run_id"], "targets": phases,
        "target": "x86_emulator" if phases == "with_htp" else "cpu", "experiment": args.experiment,
        "overrides": " ".join(args.overrides),
    }):
        mlflow.log_metrics(summary)
        mlflow.log_text(table.round(3).to_csv(), "stages.csv")


if __name__ == "__main__":
    main()
