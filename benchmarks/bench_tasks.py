"""Benchmark what `eval.tasks` adds to a run: the default experiment without and with tasks, on one fresh cache, in
one invocation (the project's target for SmolLM2 on a 2-core box: the FP + QDQ task phases add <= 5 minutes).

Three runs: plain (cold: fills the cache), plain again (warm), with tasks (warm except the tasks, which are cold:
the FP phase's task results are not cached yet). Printed: each wall time, what the tasks added (wall difference and
the runs' own `time_tasks_fp_s` / `time_tasks_qdq_s`), per item and per graph call, and the ratio to the target.
Logged as one run of the MLflow experiment `benchmarks`.

    .venv/bin/python benchmarks/bench_tasks.py                               # SmolLM2, both wikitext tasks, all items
    .venv/bin/python benchmarks/bench_tasks.py eval.task_limit=200           # 200 items per task
    .venv/bin/python benchmarks/bench_tasks.py model=tiny eval.task_limit=20 # a quick check
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run, run_qexp  # noqa: E402
from qexp.tracking.address import embedded_store_uri  # noqa: E402

TASKS = "eval.tasks=[qexp_lastword_wikitext,qexp_choice_wikitext]"
TARGET_ADDED_S = 5 * 60.0


def _run_id(proc) -> str:
    """From the line `python -m qexp` ends with: `qexp: run <id> (<name>) finished: ...` (on stderr)."""
    return next(line.split()[2] for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("qexp: run "))


def main() -> None:
    args = sys.argv[1:]
    store = embedded_store_uri()
    client = MlflowClient(store)
    common = ["tracking.experiment=benchmarks_runs", "tracking.force=true", *args]
    with tempfile.TemporaryDirectory(prefix="qexp-bench-tasks-") as cache:
        os.environ["QEXP_CACHE_DIR"] = cache
        cold_s, _ = run_qexp("plain, cold", common, store)
        plain_s, _ = run_qexp("plain, warm", common, store)
        tasks_s, proc = run_qexp("with tasks", [*common, TASKS], store)
    run = client.get_run(_run_id(proc))
    m = run.data.metrics
    stage_fp, stage_qdq = m.get("time_tasks_fp_s", float("nan")), m.get("time_tasks_qdq_s", float("nan"))
    items = sum(v for k, v in m.items() if k.startswith("task.") and k.endswith(".items"))
    added = tasks_s - plain_s
    print(f"plain run: {cold_s:.0f} s cold, {plain_s:.0f} s warm; with tasks: {tasks_s:.0f} s "
          f"({items:.0f} items in all)")
    print(f"tasks added {added:.0f} s wall (stages: FP {stage_fp:.0f} s, QDQ {stage_qdq:.0f} s; "
          f"{(stage_fp + stage_qdq) / max(items, 1):.2f} s per item over both phases); target <= "
          f"{TARGET_ADDED_S:.0f} s: ratio {added / TARGET_ADDED_S:.2f}")
    with benchmark_run(store, "tasks", "tasks", {"args": " ".join(args)}):
        mlflow.log_metrics({"plain_cold_s": cold_s, "plain_warm_s": plain_s, "with_tasks_s": tasks_s,
                            "added_s": added, "tasks_fp_s": stage_fp, "tasks_qdq_s": stage_qdq, "items": items,
                            "ratio_to_target": added / TARGET_ADDED_S})


if __name__ == "__main__":
    main()
