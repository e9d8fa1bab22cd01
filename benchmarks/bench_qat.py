"""What quantization-aware training costs: a default-budget QAT run (`algorithm=[qat]`, conf/algorithm/qat.yaml) of a
model on a cold cache, its training minutes and the run's peak memory, beside the same run without QAT measured in
the same invocation (so the ratio holds across machines).

    .venv/bin/python benchmarks/bench_qat.py [--model smollm2_135m] [--extra algorithm.qat.lr=1e-4 ...]

Peak memory is the process's maximum resident set (getrusage of the child), the figure the issue's 8 GiB bound is on.
"""

from __future__ import annotations

import argparse
import re
import resource
import tempfile

import pandas as pd

from common import run_qexp, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for both runs")
    parser.add_argument("--write-results", action="store_true", help="also write results/qat_cost.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="qexp-bench-qat-") as folder:
        store = f"sqlite:///{folder}/store.db"
        base = [f"model={args.model}", "quant=16a4w", "eval.limit=8", "calibration.limit=8",
                f"cache_dir={folder}/cache", "tracking.experiment=bench_qat", *args.extra]
        for label, algorithm in (("RTN", "algorithm=[]"), ("QAT", "algorithm=[qat]")):
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            wall, proc = run_qexp(label, base + [algorithm], store)
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far (KiB)
            minutes = re.search(r"QAT: trained (\d+) steps in ([\d.]+) min", proc.stderr + proc.stdout)
            rows.append({"run": label, "wall_min": wall / 60,
                         "qat_train_min": float(minutes.group(2)) if minutes else None,
                         "peak_rss_gib": max(peak, before) / 2 ** 20})
    table = pd.DataFrame(rows)
    table["wall_vs_rtn"] = table["wall_min"] / table["wall_min"].iloc[0]
    print(table.to_string(index=False))
    if args.write_results:
        write_result("qat_cost", table, "benchmarks/bench_qat.py " + " ".join(
            [f"--model {args.model}"] + ([f"--extra {' '.join(args.extra)}"] if args.extra else [])),
            ["Cold cache (both runs share it: the QAT run reuses the RTN run's FP evaluation).",
             "peak_rss_gib: the largest child process's maximum resident set so far (getrusage), cumulative: the QAT "
             "row is the larger of the two runs."])


if __name__ == "__main__":
    main()
