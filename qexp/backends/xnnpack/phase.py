"""The XNNPACK phase: export (cached), the .pte's log-likelihoods on all of the run's windows, speed and roofline."""

from __future__ import annotations

import logging
import math

from qexp.backends.base import PhaseInputs, PhaseResult
from qexp.backends.bench import measure
from qexp.backends.xnnpack.export import export_program
from qexp.backends.xnnpack.roofline import decode_bytes_per_token, measured_bandwidth_gbs
from qexp.backends.xnnpack.runner import XnnpackRunner
from qexp.eval.perplexity import evaluate

log = logging.getLogger("qexp")


def _export(inputs: PhaseInputs):
    """The run's .pte (cached) and the longest prefill it takes."""
    backend, windows = inputs.cfg.backend, inputs.windows
    bench = backend.bench
    context = max(windows.seq_len, bench.prompt_len + bench.new_tokens)
    max_prefill = max(windows.seq_len, bench.prompt_len)
    with inputs.timer.stage("export_xnnpack"):
        return export_program(inputs.model, backend, context, max_prefill, inputs.cache, inputs.versions), max_prefill


def task_scorer(inputs: PhaseInputs):
    """The run's .pte (from the cache, or exported) as a task scorer."""
    program, max_prefill = _export(inputs)
    return _scorer(XnnpackRunner(program, inputs.cfg.backend.threads), max_prefill)


def _scorer(runner: XnnpackRunner, max_prefill: int):
    from qexp.tasks.deployed import DeployedScorer

    return DeployedScorer(runner.rows, max_prefill, "XNNPACK tasks")


def run_phase(inputs: PhaseInputs) -> PhaseResult:
    backend, windows, timer = inputs.cfg.backend, inputs.windows, inputs.timer
    bench = backend.bench
    program, max_prefill = _export(inputs)
    result = PhaseResult(tags={"target": "cpu", "speed_source": "measured", "pte_cache_key": program.key,
                               "pte_cache_hit": str(program.cache_hit).lower()})
    result.metrics["pte_bytes"] = program.pte_bytes
    runner = XnnpackRunner(program, backend.threads)
    with timer.stage("eval_deployed"):
        result.deployed = evaluate(runner.window_logits, windows, "XNNPACK", keep_logits=len(inputs.fp.logits))
    if inputs.cfg.eval.get("deployed_task_limit"):
        result.task_scorer = _scorer(runner, max_prefill)

    prompt = [int(t) for t in windows.ids[0][: bench.prompt_len]]
    with timer.stage("bench_deployed"):
        speed, _ = measure(lambda: runner.generate(prompt, bench.new_tokens), bench.warmup, bench.repeats)
    metrics = result.metrics
    metrics.update({k: v for k, v in speed.items() if not math.isnan(v)})
    metrics["threads"] = runner.threads
    bandwidth = measured_bandwidth_gbs(inputs.cache, runner.threads)
    per_token = decode_bytes_per_token(program.pte_bytes, inputs.model.params, backend.embedding_quantize,
                                       bench.prompt_len + bench.new_tokens / 2)
    metrics.update({"mem_bandwidth_gbs": bandwidth, "decode_bytes_per_token": per_token})
    if "decode_tok_s" in metrics:
        achieved = per_token * metrics["decode_tok_s"] / 1e9
        metrics.update({"decode_achieved_gbs": achieved, "decode_bw_efficiency": achieved / bandwidth})
    log.info("speed on cpu (%d threads): TTFT %.1f ms, prefill %.1f tok/s, decode %.1f tok/s; "
             "decode reads %.1f MB/token = %.2f GB/s of %.2f GB/s measured (%.0f%%)", runner.threads,
             metrics["ttft_ms"], metrics["prefill_tok_s"], metrics.get("decode_tok_s", float("nan")), per_token / 1e6,
             metrics.get("decode_achieved_gbs", float("nan")), bandwidth,
             100 * metrics.get("decode_bw_efficiency", float("nan")))
    return result
