"""The run's last two stages: lm-eval tasks and the generation check on the float and QDQ programs, and the
backend's deployed phase, whose log-likelihoods are compared with FP and QDQ on exactly the windows it scored."""

from __future__ import annotations

import logging

import numpy as np

from qexp.eval.compare import compare, phase_metrics
from qexp.core.timing import release_memory

log = logging.getLogger("qexp")


def tasks(state) -> None:
    """eval.tasks through lm-eval on the FP and QDQ phases (qexp/tasks/stage.py); the generation check."""
    if state.cfg.eval.get("tasks"):
        from qexp.tasks.stage import score_tasks

        score_tasks(state)
    if state.cfg.eval.get("generation_check"):
        from qexp.tasks.generation import check_generation
        from qexp.tasks.programs import fp_program, qdq_program

        check_generation(state, [fp_program(state)] + ([qdq_program(state)] if state.qdq is not None else []))


def deploy(state) -> None:
    """The backend's phase; its log-likelihoods are compared with FP and QDQ on exactly the windows it scored."""
    if not state.backend.deploys:
        return
    from qexp.tracking.runlog import native_output_captured

    # The FP and QDQ float programs are not read again (their results are): freed before the compile's memory peak
    state.fp_static = state.deploy_static = None
    if state.qdq is not None:
        state.qdq.release_programs()
    release_memory()
    inputs = state.phase_inputs()
    log.info("stage deploy (%s): native library output goes to the run's native.log (verbose=true shows it)",
             state.cfg.backend.name)
    native = None
    try:
        with native_output_captured(enabled=not state.cfg.verbose) as native:
            result = state.backend.run(inputs)
    finally:
        if native is not None and native.getvalue():
            state.log_text(native.getvalue(), "native.log")
    state.metrics.update(result.metrics)
    state.tags.update({"deployed_phase": state.cfg.backend.name, **result.tags})
    for path, content in result.texts.items():
        state.log_text(content, path)
    if result.deployed is not None:
        _score_deployed(state, result.deployed)
    if result.task_scorer is not None:
        from qexp.tasks.stage import score_deployed_tasks

        score_deployed_tasks(state, result.task_scorer)


def _score_deployed(state, deployed) -> None:
    subset, windows = deployed.windows, state.windows
    whole = subset.ids.shape == windows.ids.shape and np.array_equal(subset.ids, windows.ids)
    fp_sub = state.fp if whole else state.fp.head(subset)
    metrics = state.metrics
    metrics.update(phase_metrics(deployed, "deployed"))
    metrics.update({f"{k}_fp_sub": v for k, v in fp_sub.metrics().items() if k in ("ppl", "word_ppl")})
    metrics.update(compare(deployed, fp_sub, "deployed", "fp"))
    if state.qdq is not None:
        qdq_sub = state.qdq.result if whole else state.qdq.result.head(subset)
        metrics.update({f"{k}_qdq_sub": v for k, v in qdq_sub.metrics().items() if k in ("ppl", "word_ppl")})
        metrics.update(compare(deployed, qdq_sub, "deployed", "qdq"))
    metrics.update({"deployed_eval_tokens": subset.n_predicted, "deployed_eval_windows": subset.n_windows})
    if subset.ids.shape[1] == windows.ids.shape[1] and np.array_equal(subset.ids, windows.ids[:subset.n_windows]):
        # whole windows (the first n): per window, NaN after them, so a report pairs two runs' deployed phases
        ll = np.full(windows.n_windows, np.nan)
        ll[:subset.n_windows] = deployed.logprobs.sum(axis=1)
        state.per_window["ll_deployed"] = ll
    reference = "qdq" if state.qdq is not None else "fp"
    delta = f"ppl_deployed_vs_{reference}"
    log.info("%s (%s): ppl %.3f vs %s %.3f on the same %d tokens (%+.2f%%, 95%% interval [%+.2f, %+.2f]), top-1 "
             "agreement %.3f", state.cfg.backend.name.upper(), state.tags.get("target", "?"), metrics["ppl_deployed"],
             reference.upper(), metrics[f"ppl_{reference}_sub"], subset.n_predicted, 100 * metrics[delta],
             100 * metrics.get(f"{delta}_ci_low", float("nan")), 100 * metrics.get(f"{delta}_ci_high", float("nan")),
             metrics[f"top1_agreement_deployed_vs_{reference}"])
    hint = state.backend.scoring_hint(state.tags.get("qdq_arithmetic"), metrics)
    if hint:
        log.info(hint)
