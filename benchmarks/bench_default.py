"""Benchmark the default experiment cold (empty cache) and warm (everything cached), this checkout side by side with
a baseline commit (default: the previous one), in one invocation on the same machine.

Order: baseline cold, this cold, baseline warm, this warm (each side warm on its own cache). Every run is a
subprocess `python -m qexp +experiment=16a4w_wikitext` (the baseline from a `git worktree` of its commit, with the
same .venv). Per run: wall time, each stage's time, the peak memory of the whole process tree (compile workers and the
watchdog included: the sum of their RSS sampled every 0.2 s, an upper bound, see TreeMemory; and the peak rise of
the machine's memory in use, which counts pages a forked worker shares with its parent once), and the terminal lines
the run printed. Then the ratios this / baseline and this / target, and whether both sides give the same
perplexities (they must: a speed change may not change a result). Targets (the project's, on a 2-core 24 GiB box):
cold <= 8 min, warm <= 2 min, peak memory <= 6 GiB. Logged as one run of the MLflow experiment `benchmarks`;
emulator stages are x86 HTP emulator time, not phone time.

    .venv/bin/python benchmarks/bench_default.py                        # vs HEAD~1
    .venv/bin/python benchmarks/bench_default.py --baseline a5f432f     # vs a given commit
    .venv/bin/python benchmarks/bench_default.py --baseline none backend=none   # this checkout only, CPU phases
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlflow
import pandas as pd
import psutil
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run, machine_used_mib  # noqa: E402
from qexp.tracking.address import embedded_store_uri  # noqa: E402

TARGETS = {"cold_s": 8 * 60.0, "warm_s": 2 * 60.0, "peak_mem_mb": 6 * 1024.0}
RESULTS = ("ppl_fp", "ppl_qdq", "ppl_deployed")


class TreeMemory:
    """Peak RSS (MiB) summed over a process and all its descendants, sampled in a thread from /proc/PID/statm.

    An upper bound: pages a forked compile worker shares copy-on-write with its parent count twice. PSS would count
    them once, but reading it (/proc/PID/smaps_rollup) walks the process's page tables under its memory lock, and
    sampled every second it slowed SmolLM2's FP evaluation ~10x (measured): a benchmark must not do that."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every = pid, every
        self.peak_rss = 0.0
        # the other measure: the machine's memory in use, its peak rise over what was in use when the run started
        self.machine_before, self.peak_machine_rise = machine_used_mib(), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = 0
            for proc in procs:
                try:
                    rss += proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak_rss = max(self.peak_rss, rss / 2**20)
            self.peak_machine_rise = max(self.peak_machine_rise, machine_used_mib() - self.machine_before)
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_once(label: str, checkout: Path, cache_dir: str, store: str, args: list[str]) -> dict:
    command = [sys.executable, "-m", "qexp", *args, f"cache_dir={cache_dir}", "tracking.experiment=benchmarks",
               f"tracking.run_name=bench-{label}"]
    print(f"[bench] {label}: {' '.join(command[1:])}  (in {checkout})", flush=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    # bytes, not text mode: text mode turns a progress bar's in-place "\r" updates into lines a terminal never shows
    proc = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    memory = TreeMemory(proc.pid)
    out_bytes, err_bytes = proc.communicate()
    lines = out_bytes.count(b"\n") + err_bytes.count(b"\n")  # as a terminal shows them
    out, err = out_bytes.decode(errors="replace"), err_bytes.decode(errors="replace")
    wall = time.perf_counter() - start
    memory.stop()
    if proc.returncode != 0:
        sys.stderr.write(err[-3000:])
        raise SystemExit(f"[bench] {label} failed (exit {proc.returncode})")
    run_id = next(line.split()[2] for line in out.splitlines() if line.startswith("qexp: run "))
    metrics = MlflowClient(store).get_run(run_id).data.metrics
    print(f"[bench] {label}: {wall:.1f} s, peak tree RSS {memory.peak_rss:.0f} MiB (summed), machine memory in use "
          f"+{memory.peak_machine_rise:.0f} MiB at peak, {lines} terminal lines", flush=True)
    return {"label": label, "run_id": run_id, "wall_s": wall, "tree_peak_rss_mb": memory.peak_rss,
            "machine_peak_rise_mb": memory.peak_machine_rise,
            "terminal_lines": lines, **metrics}


def baseline_checkout(ref: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), ref], check=True,
                   capture_output=True, text=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="16a4w_wikitext")
    parser.add_argument("--baseline", default="HEAD~1", help="a commit to compare with, or 'none'")
    parser.add_argument("--store", default=os.environ.get("MLFLOW_TRACKING_URI") or embedded_store_uri())
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    qexp_args = [f"+experiment={args.experiment}", *args.overrides]
    this_commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="qexp-bench-") as tmp:
        tmp = Path(tmp)
        sides = {"this": REPO}
        if args.baseline != "none":
            sides = {"baseline": baseline_checkout(args.baseline, tmp / "baseline"), **sides}
        try:
            for phase in ("cold", "warm"):
                for side, checkout in sides.items():
                    runs[f"{side}_{phase}"] = run_once(f"{side}-{phase}", checkout, str(tmp / f"cache-{side}"),
                                                       args.store, qexp_args)
        finally:
            if "baseline" in sides:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(sides["baseline"])],
                               capture_output=True)

    stages = sorted({k for r in runs.values() for k in r if k.startswith("time_")})
    table = pd.DataFrame({label: [r.get(s) for s in stages] for label, r in runs.items()},
                         index=[s[len("time_"):-2] for s in stages])
    for row, key in (("wall (process)", "wall_s"), ("tree peak RSS MiB", "tree_peak_rss_mb"),
                     ("machine in-use rise MiB", "machine_peak_rise_mb"),
                     ("qexp peak RSS MiB", "peak_rss_mb"),
                     ("terminal lines", "terminal_lines")):
        table.loc[row] = [r.get(key) for r in runs.values()]
    print("\nper-stage seconds (nested: export/prepare/calibrate/convert inside quantize; quantize_*/lower/"
          "to_executorch inside compile; HTP stages are x86 emulator time)")
    print(table.round(1).to_string())

    this_cold, this_warm = runs["this_cold"], runs["this_warm"]
    peak = max(this_cold["tree_peak_rss_mb"], this_warm["tree_peak_rss_mb"])
    # each page once (summed RSS counts a forked worker's shared pages twice): the tree's physical peak
    machine_peak = max(this_cold["machine_peak_rise_mb"], this_warm["machine_peak_rise_mb"])
    summary = {
        "cold_wall_s": this_cold["wall_s"], "warm_wall_s": this_warm["wall_s"], "peak_tree_rss_mb": peak,
        "cold_vs_target": this_cold["wall_s"] / TARGETS["cold_s"],
        "warm_vs_target": this_warm["wall_s"] / TARGETS["warm_s"],
        "peak_mem_vs_target": peak / TARGETS["peak_mem_mb"],
        "peak_machine_rise_mb": machine_peak,
        "peak_machine_rise_vs_target": machine_peak / TARGETS["peak_mem_mb"],
        "terminal_lines_cold": this_cold["terminal_lines"],
    }
    if "baseline_cold" in runs:
        base_cold, base_warm = runs["baseline_cold"], runs["baseline_warm"]
        summary.update({
            "cold_vs_baseline": this_cold["wall_s"] / base_cold["wall_s"],
            "warm_vs_baseline": this_warm["wall_s"] / base_warm["wall_s"],
            "peak_mem_vs_baseline": peak / max(base_cold["tree_peak_rss_mb"], base_warm["tree_peak_rss_mb"]),
            "lower_vs_baseline": this_cold.get("time_lower_s", float("nan")) /
                                 base_cold.get("time_lower_s", float("nan")),
        })
    print(f"\nratios (< 1.0: faster / smaller; targets: cold {TARGETS['cold_s']:.0f} s, "
          f"warm {TARGETS['warm_s']:.0f} s, {TARGETS['peak_mem_mb']:.0f} MiB):")
    for key, value in summary.items():
        print(f"  {key:24s} {value:.3f}")

    same = {}
    for metric in RESULTS:
        values = {label: r.get(metric) for label, r in runs.items() if r.get(metric) is not None}
        same[metric] = len(set(values.values())) <= 1
        print(f"  {metric:24s} {'identical' if same[metric] else 'DIFFERENT'} " +
              " ".join(f"{k}={v:.6f}" for k, v in values.items()))
    summary["results_identical"] = float(all(same.values()))

    with benchmark_run(args.store, f"bench_default-{args.experiment}", "bench_default", {
        "this_commit": this_commit, "baseline": args.baseline, "experiment": args.experiment,
        "overrides": " ".join(args.overrides), "target": "x86_emulator", **{f"run.{k}": r["run_id"]
                                                                             for k, r in runs.items()},
    }):
        mlflow.log_metrics(summary)
        mlflow.log_text(table.round(3).to_csv(), "stages.csv")


if __name__ == "__main__":
    main()
