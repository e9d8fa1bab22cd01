"""The run's tasks stage: eval.tasks through lm-eval on the FP phase (cached by model and items) and the QDQ
program; every task metric per phase, the per-item values as artifacts, and QDQ against FP item by item. The deployed
program (XNNPACK's .pte, HTP's on the emulator) scores the first eval.deployed_task_limit items after its phase,
paired with FP and QDQ on those items."""

from __future__ import annotations

import logging
from typing import List

from qexp.core.provenance import fp_task_key
from qexp.tasks.harness import TaskResult, cached_task_result, evaluate_tasks, paired_task_deltas
from qexp.tasks.lm import QexpLM
from qexp.tasks.programs import fp_program, qdq_program
from qexp.tasks.suite import prepare_suite
from qexp.core.timing import release_memory

log = logging.getLogger("qexp")


def score_tasks(state) -> None:
    cfg = state.cfg
    suite = prepare_suite(cfg, state.cache)
    try:
        def score(program):
            lm = QexpLM(program.scorer, program.tokenizer, program.add_bos)
            return evaluate_tasks(lm, suite.names, suite.include_paths, suite.limit, program.phase)

        with state.timer.stage("tasks_fp"):
            key = fp_task_key(cfg, state.model, state.fp_static, suite.key())
            fp, hit = cached_task_result(state.cache, key, "fp", lambda: score(fp_program(state)))
        state.tags["fp_tasks_cache_hit"] = str(hit).lower()
        results = [fp]
        if state.qdq is not None:
            with state.timer.stage("tasks_qdq"):
                results.append(score(qdq_program(state)))
                release_memory()
    finally:
        suite.close()
    _log_results(state, results)
    if len(results) == 2:
        state.metrics.update(paired_task_deltas(results[1], results[0]))
    state.tags.update({f"task.{name}.sha256": suite.hashes[name][:16] for name in suite.names})
    state.tags.update({f"task.{name}.built_from": text for name, text in suite.described.items()})
    state.task_results = results


def score_deployed_tasks(state, scorer) -> None:
    """The deployed program (`scorer`: its backend's qexp.tasks.deployed.DeployedScorer) on the first
    eval.deployed_task_limit items of each task (at most eval.task_limit), paired with every CPU phase's result on
    the same items: `task.<task>.<metric>_deployed_vs_fp` / `_vs_qdq`."""
    cfg = state.cfg
    suite = prepare_suite(cfg, state.cache)
    limit = min(int(cfg.eval.deployed_task_limit), suite.limit or int(cfg.eval.deployed_task_limit))
    try:
        with state.timer.stage("tasks_deployed"):
            lm = QexpLM(scorer, state.model.tokenizer, state.model.add_bos)
            result = evaluate_tasks(lm, suite.names, suite.include_paths, limit, "deployed")
    finally:
        suite.close()
    _log_results(state, [result])
    for reference in state.task_results:
        state.metrics.update(paired_task_deltas(result, reference))


def _log_results(state, results: List[TaskResult]) -> None:
    for result in results:
        state.metrics.update(result.logged())
        state.log_text(result.items.to_csv(index=False, float_format="%.17g"), f"tasks/items_{result.phase}.csv")
        for task, values in result.metrics.items():
            shown = ", ".join(f"{k} {v:.4g}" for k, v in values.items() if not k.endswith("_stderr"))
            log.info("%s %s (%d items): %s", result.phase.upper(), task, result.n_items.get(task, 0), shown)
