"""Benchmark shared work in a sweep: one 4-config multirun vs four independent cold runs of the same configs.

Each independent run gets its own empty cache (it loads the model, dequantizes the GGUF, evaluates FP, calibrates);
the sweep gets one empty cache for all four jobs (model load, text, windows and the FP-phase evaluation are done once,
by the first job, and shared through the content-addressed cache). All five are subprocesses in one invocation, so
they share the machine's state. Target: sweep <= 0.6 x the sum of the independent runs.

    .venv/bin/python benchmarks/bench_sweep.py                                  # SmolLM2, FP + QDQ phases
    .venv/bin/python benchmarks/bench_sweep.py --configs 8a8w,16a4w model=tiny  # quick check
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run, run_qexp  # noqa: E402
from qexp.tracking.address import embedded_store_uri  # noqa: E402

TARGET_RATIO = 0.6


def timed(label: str, args: list[str], store: str) -> float:
    return run_qexp(label, args, store)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="8a8w,16a8w,16a4w,16a4w_block", help="quant configs of the sweep")
    parser.add_argument("--store", default=os.environ.get("MLFLOW_TRACKING_URI") or embedded_store_uri())
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (default backend=none)")
    args = parser.parse_args()
    configs = args.configs.split(",")
    common = ["backend=none", "tracking.experiment=benchmarks", *args.overrides]
    stamp = time.strftime("%Y%m%d-%H%M%S")

    walls = {}
    with tempfile.TemporaryDirectory(prefix="qexp-bench-sweep-") as tmp:
        for config in configs:
            walls[config] = timed(f"independent {config}", [f"quant={config}", f"cache_dir={tmp}/{config}",
                                                            f"tracking.run_name=bench-independent-{config}", *common],
                                  args.store)
        sweep_wall = timed("sweep", ["--multirun", f"quant={args.configs}", f"cache_dir={tmp}/sweep",
                                     f"tracking.sweep=bench-{stamp}", "tracking.force=true",
                                     f"hydra.sweep.dir={tmp}/multirun", *common], args.store)

    independent = sum(walls.values())
    ratio = sweep_wall / independent
    table = pd.DataFrame({"wall_s": {**{f"independent {c}": w for c, w in walls.items()},
                                     "independent, sum": independent, f"sweep of {len(configs)}": sweep_wall}})
    print("\n" + table.round(1).to_string())
    print(f"\nsweep / sum of independent cold runs = {ratio:.3f} (target <= {TARGET_RATIO}: "
          f"{'met' if ratio <= TARGET_RATIO else 'NOT met'})")

    with benchmark_run(args.store, "bench_sweep", "bench_sweep",
                       {"configs": args.configs, "overrides": " ".join(common), "target": "cpu"}):
        mlflow.log_metrics({"independent_sum_s": independent, "sweep_s": sweep_wall, "sweep_vs_independent": ratio,
                            "sweep_vs_independent_target": TARGET_RATIO,
                            **{f"independent_{c}_s": w for c, w in walls.items()}})
        mlflow.log_text(table.round(2).to_csv(), "walls.csv")


if __name__ == "__main__":
    main()
