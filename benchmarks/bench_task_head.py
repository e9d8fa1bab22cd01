"""Benchmark the task phases' output head on the scored rows only (qexp/tasks/head_rows.py) against the full head, side
by side in one process, on the same requests: seconds per phase each way, the ratio, and the largest difference in a
request's log-likelihood (the rows-only head must give the full head's scores).

The programs come from qexp's caches (built where missing) for the Hydra overrides given; the requests are the first
N items of each of qexp's two wikitext tasks. Logged as one run of the MLflow experiment `benchmarks`.

    .venv/bin/python benchmarks/bench_task_head.py                          # SmolLM2, 200 items per task, FP and QDQ
    .venv/bin/python benchmarks/bench_task_head.py 100 -- model=gemma3_270m # Gemma-3-270m: a 262,144-token head
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _requests(cfg, lm, n: int):
    from lm_eval.tasks import TaskManager

    from qexp.cache import Cache
    from qexp.data.text import load_corpus
    from qexp.tasks.offline import write_task

    corpus = load_corpus(cfg.text, Cache(cfg.cache_dir))
    with tempfile.TemporaryDirectory() as root:
        names = [write_task(kind, "wikitext", list(corpus.test["text"]), corpus.source, corpus.sha256,
                            Path(root)).name for kind in ("lastword", "choice")]
        requests = []
        for task in TaskManager(include_path=root, include_defaults=False).load(names)["tasks"].values():
            task.build_all_requests(limit=n, rank=0, world_size=1)
            requests += list(task.instances)
    return requests


def main() -> None:
    import qexp  # noqa: F401  (first: it sets the hub offline before lm-eval imports `datasets`)
    import mlflow

    from benchmarks.common import benchmark_run
    from qexp.compose import compose
    from qexp.lm_eval_model import phase_program
    from qexp.tasks.lm import QexpLM
    from qexp.tracking.address import embedded_store_uri

    argv = sys.argv[1:]
    overrides = ["backend=none", *(argv[argv.index("--") + 1:] if "--" in argv else [])]
    head = argv[: argv.index("--")] if "--" in argv else argv
    n = int(head[0]) if head else 200
    cfg = compose(overrides)
    figures = {}
    for phase in ("fp", "qdq"):
        program = phase_program(overrides=" ".join(overrides), phase=phase)
        lm = QexpLM(program.scorer, program.tokenizer, program.add_bos)
        requests = _requests(cfg, lm, n)
        rows = program.scorer.head_rows
        if rows is None:
            raise SystemExit(f"[bench] {phase}: the program's head was not found; nothing to compare")
        seconds, scores = {}, {}
        for label, selector in (("rows", rows), ("full", None)):
            program.scorer.head_rows = selector  # the rewritten QDQ graph takes every row outside a selection
            start = time.perf_counter()
            scores[label] = lm.loglikelihood(requests)
            seconds[label] = time.perf_counter() - start
        diff = max(abs(a[0] - b[0]) for a, b in zip(scores["rows"], scores["full"]))
        ratio = seconds["full"] / seconds["rows"]
        print(f"{phase}: {len(requests)} requests ({n} items per task, {cfg.model.name}): full head "
              f"{seconds['full']:.1f} s, scored rows only {seconds['rows']:.1f} s: {ratio:.2f}x; largest "
              f"log-likelihood difference {diff:.2g}", flush=True)
        figures.update({f"{phase}_full_s": seconds["full"], f"{phase}_rows_s": seconds["rows"],
                        f"{phase}_ratio": ratio, f"{phase}_max_diff": diff})
    with benchmark_run(embedded_store_uri(), "task_head", "task_head", {"args": " ".join(argv)}):
        mlflow.log_metrics(figures)


if __name__ == "__main__":
    main()
