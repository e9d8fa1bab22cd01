"""The HTP phase: compile the calibrated model for a SoC (or load a compiled .pte), run it, score it on-target,
time it.

On this machine the target is the x86_64 HTP emulator: every timing is tagged target=x86_emulator and measures
the emulator, not a phone. On-target perplexity uses a head of the evaluation windows (the emulator is slow); the
pipeline scores FP and QDQ on exactly that head (`*_sub`), so the three are comparable.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from qexp.backends.base import PhaseInputs, PhaseResult
from qexp.backends.htp.config import ModelMode, Target
from qexp.backends.htp.lower import META_FILE, PREFILL_GRAPH, DeployedProgram, compile_pte
from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
from qexp.cache import stable_hash
from qexp.data.windows import Windows
from qexp.core.errors import ConfigError, InputError
from qexp.eval.perplexity import cached_evaluation, evaluate

log = logging.getLogger("qexp")

PRE_GENERATED = "pre-generated"  # the cache key of a .pte passed as backend.pte_path


def load_program(path: str) -> DeployedProgram:
    pte = Path(path).expanduser()
    meta_path = pte.parent / META_FILE
    if not pte.is_file():
        raise InputError(f"backend.pte_path not found: {pte}", "pass a .pte that qexp compiled (its cache entry)")
    if not meta_path.is_file():
        raise InputError(
            f"{meta_path.name} missing beside {pte}",
            "qexp needs the I/O encodings it writes next to the .pte it compiles; pass such a .pte",
        )
    return DeployedProgram(pte, json.loads(meta_path.read_text()), key=PRE_GENERATED, cache_hit=True)


def run_phase(inputs: PhaseInputs, adb=None) -> PhaseResult:
    cfg, timer = inputs.cfg, inputs.timer
    backend = cfg.backend
    device = None
    if backend.target == Target.android:
        from qexp.backends.htp.android import android_target

        device = android_target(cfg, inputs.model, inputs.cache, adb)  # checked before the long compile
    sdk = ensure_qnn_sdk(inputs.cache)
    result = PhaseResult(tags={"target": backend.target.value, "version.qnn_libs": sdk.version})
    with timer.stage("compile"):
        if backend.pte_path:
            program = load_program(backend.pte_path)
        else:
            program = compile_pte(inputs.model, cfg, inputs.qdq.program, inputs.qdq.r3, inputs.cache, timer,
                                  inputs.versions)
    result.tags.update({"pte_cache_key": program.key, "pte_cache_hit": str(program.cache_hit).lower()})
    result.metrics["pte_bytes"] = program.pte_bytes
    for graph, counts in program.meta["delegation"].items():
        result.metrics[f"delegated_nodes_{graph}"] = counts["delegated"]
        result.metrics[f"non_delegated_nodes_{graph}"] = counts["non_delegated"]
    estimate_speed(inputs, program, result)
    if device is not None:
        from qexp.backends.htp.android import run_on_device

        return run_on_device(inputs, program, device, result)
    _evaluate_on_emulator(inputs, program, result)
    return result


def estimate_speed(inputs: PhaseInputs, program: DeployedProgram, result: PhaseResult) -> None:
    """The program's speed on a phone with its SoC, estimated (qexp/speed): TTFT at the bench's prompt length,
    prefill and decode tokens/s, each with the model's error; and QNN's DDR summary of each graph, whose spills
    say the program is slower than its weights suggest."""
    from qexp.speed import DECODE_GRAPH, estimate_program
    from qexp.speed.bytes import Shapes

    for graph, ddr in (program.meta.get("ddr") or {}).items():
        for key, value in (ddr or {}).items():
            result.metrics[f"ddr_{key}_{graph}"] = value
    spilling = {g: d for g, d in (program.meta.get("ddr") or {}).items() if d and d["spill_bytes"] + d["fill_bytes"]}
    if spilling:
        result.tags["ddr_spills"] = ",".join(spilling)
        log.warning("QNN says %s spill%s activations to DRAM (%s): slower on a phone than its weights say, beyond "
                    "what the speed estimate counts", ", ".join(spilling), "s" if len(spilling) == 1 else "",
                    "; ".join(f"{g}: spill {d['spill_bytes']:,} / fill {d['fill_bytes']:,} bytes"
                              for g, d in spilling.items()))
    simulated = {g: s for g, s in (program.meta.get("sim") or {}).items() if s}
    for graph, sim in simulated.items():
        for key, value in sim.items():
            result.metrics[f"htp_sim_{key}_{graph}"] = value
    if simulated:
        log.info("QNN's simulated cycles of one call (%s, a relative cost, not a phone's time): %s",
                 program.meta["soc"],
                 "; ".join(f"{g} {s['cycles']:,} ({s['cycles_lower']:,}..{s['cycles_upper']:,})"
                           + (f", {s['missing_ops']} ops without a cost" if s.get("missing_ops") else "")
                           for g, s in simulated.items()))
    soc = program.meta.get("soc", "?")
    try:
        estimate, bytes_source, counts = estimate_program(Shapes.of(inputs.model.params), inputs.cfg.quant,
                                                          program.meta, int(inputs.cfg.backend.bench.prompt_len))
    except (ConfigError, KeyError, ValueError) as exc:  # a SoC without figures, a user's .pte whose meta.json says
        # too little: the run's perplexities still stand; it says in one line why it has no speed estimate
        log.warning("no speed estimate: %s", exc if isinstance(exc, ConfigError) else
                    f"{type(exc).__name__}: {exc} (the program's meta.json lacks what the estimate reads)")
        result.tags["speed_source"] = "none"
        return
    result.metrics.update(estimate.metrics())
    for graph, count in counts.items():
        result.metrics[f"stream_bytes_{graph}"] = count["analytic"].total
        if count["qnn"] is not None:
            result.metrics[f"qnn_vs_counted_bytes_{graph}"] = count["qnn"].total / count["analytic"].total
    result.metrics["weight_bytes_streamed"] = counts[DECODE_GRAPH]["analytic"].weights
    result.tags.update({"speed_source": estimate.source, "speed_bytes_source": bytes_source, "speed_soc": soc})
    log.info("speed on %s, estimated (%s, bytes from %s): decode %.0f tok/s %s, TTFT %.1f ms %s for %d prompt tokens "
             "(prefill %.0f tok/s)%s; the model's median error on published figures: decode %.0f%%, TTFT %.0f%%",
             soc, estimate.source, bytes_source, estimate.decode_tok_s, estimate.interval("decode"), estimate.ttft_ms,
             estimate.interval("ttft"), estimate.prompt_len, estimate.prefill_tok_s,
             " (TTFT extrapolated beyond the fitted model sizes)" if estimate.ttft_extrapolated else "",
             100 * estimate.decode_err, 100 * estimate.ttft_err)


def _evaluate_on_emulator(inputs: PhaseInputs, program: DeployedProgram, result: PhaseResult) -> None:
    from qexp.backends.htp.runner import HtpRunner

    runner = HtpRunner(program)
    with inputs.timer.stage("eval_deployed"):
        result.deployed, path, reason, hit = score_on_emulator(program, runner, inputs.windows, inputs.cfg.backend,
                                                               inputs.model.tokenizer, inputs.cache)
    result.tags.update({"deployed_eval_path": path, "deployed_eval_path_reason": reason,
                        "deployed_eval_cache_hit": str(hit).lower()})
    backend = inputs.cfg.backend
    if inputs.cfg.eval.get("deployed_task_limit"):
        result.task_scorer = _scorer(runner, backend)
    if backend.bench.emulator or backend.model_mode == ModelMode.lookahead:  # lookahead: checks it decodes losslessly
        _bench(inputs, runner, result)
    else:
        log.info("emulator speed bench skipped (the x86 emulator's timings are this host's, not a phone's; "
                 "backend.bench.emulator=true runs it)")


def _scorer(runner, backend):
    from qexp.tasks.deployed import DeployedScorer

    kv_update = backend.kv_update.value
    return DeployedScorer(lambda ids, first: runner.rows(ids, first, kv_update), runner.context, "HTP tasks")


def task_scorer(inputs: PhaseInputs):
    """The run's HTP program on the emulator (compiled, or read from the cache) as a task scorer."""
    from qexp.backends.htp.runner import HtpRunner

    cfg = inputs.cfg
    if cfg.backend.target == Target.android or cfg.backend.pte_path:
        raise ConfigError("tasks score the HTP program qexp compiles, on the emulator",
                          "use backend.target=x86_emulator without backend.pte_path")
    ensure_qnn_sdk(inputs.cache)
    with inputs.timer.stage("compile"):
        program = compile_pte(inputs.model, cfg, inputs.qdq.program, inputs.qdq.r3, inputs.cache, inputs.timer,
                              inputs.versions)
    return _scorer(HtpRunner(program), cfg.backend)


def score_on_emulator(program: DeployedProgram, runner, windows: Windows, backend, tokenizer, cache):
    """On-target perplexity, on a head of the windows that every phase scores identically (backend.eval_tokens
    through the AR-N prefill graph, else eval_kv_tokens stepping the kv graph), read back from the cache where this
    program scored them before: (result, path, why that path, cache hit)."""
    if PREFILL_GRAPH in program.meta["graphs"]:
        ar = program.meta["graphs"][PREFILL_GRAPH]
        path, reason, budget = "prefill", f"AR-{ar} prefill graph", backend.eval_tokens
        logits_fn = runner.prefill_logits
    else:
        path, reason, budget = "kv", "model_mode=kv compiles no AR-N graph", backend.eval_kv_tokens
        logits_fn = lambda ids: runner.kv_logits(ids, backend.kv_update.value)[0]  # noqa: E731
    subset = windows.within_budget(budget, tokenizer)
    key = deployed_eval_key(program, subset, path, backend.kv_update.value)
    if key is None:  # a user's .pte (backend.pte_path): not content-addressed, evaluated every time
        return evaluate(logits_fn, subset, "HTP"), path, reason, False
    scored, hit = cached_evaluation(cache, key, subset, lambda: evaluate(logits_fn, subset, "HTP"))
    return scored, path, reason, hit


def deployed_eval_key(program: DeployedProgram, subset: Windows, path: str, kv_update: str):
    """The emulator's evaluation of one compiled program on one set of windows, or None for a program qexp did not
    compile. The emulator is deterministic (the same .pte gives the same logits, run after run: every side of
    benchmarks/bench_default.py agrees to all digits), so a warm re-run reads it back instead of spending ~50 s of
    emulator time on SmolLM2; the .pte's key covers the QNN libraries and every library version."""
    if program.key == PRE_GENERATED:
        return None
    return stable_hash({"phase": "htp_emulator", "pte": program.key, "windows": subset.sha256,
                        "first_target": subset.first_target, "path": path,
                        **({"kv_update": kv_update} if path == "kv" else {})}, length=24)


def _bench(inputs: PhaseInputs, runner, result: PhaseResult) -> None:
    """Speed, labelled with its target; in lookahead mode also whether decoding stayed lossless."""
    from qexp.backends.htp.runner import lookahead_layout, measure_speed, verify_lookahead

    backend, bench, timer = inputs.cfg.backend, inputs.cfg.backend.bench, inputs.timer
    updater = backend.kv_update.value
    prompt = [int(t) for t in inputs.windows.ids[0][: bench.prompt_len]]
    lookahead = lookahead_layout(runner, backend) if backend.model_mode == ModelMode.lookahead else None
    result.tags["decoder"] = "greedy" if lookahead is None else "lookahead"
    with timer.stage("bench_deployed"):
        speed, tokens = measure_speed(runner, prompt, bench.new_tokens, updater, bench.warmup, bench.repeats,
                                      lookahead)
    metrics = result.metrics
    metrics.update({k: v for k, v in speed.items() if not (isinstance(v, float) and math.isnan(v))})
    if lookahead is not None:  # lossless? the same prompt decoded greedily through the same graph, one token per call
        with timer.stage("verify_lookahead"):
            metrics.update(verify_lookahead(runner, prompt, tokens, updater))
        metrics["lookahead_decode_speedup"] = metrics["decode_tok_s"] / metrics["decode_tok_s_greedy"]
        log.info("lookahead decoding: %.2f tokens per call, %s greedy decoding's %d tokens (%.2fx its decode rate)",
                 metrics["lookahead_tokens_per_step"],
                 "the same as" if metrics["lookahead_matches_greedy"] else "DIFFERENT from", len(tokens),
                 metrics["lookahead_decode_speedup"])
        if not metrics["lookahead_matches_greedy"]:
            # The algorithm is exact; on a quantized target the accepted rows see their keys in another order
            # (in the block, not the cache), which can flip an argmax where two logits are within a rounding step.
            log.warning("lookahead output diverges from greedy after %d tokens (on a quantized target most likely an "
                        "argmax tie flipped by summation order; the float test shows the algorithm exact)",
                        int(metrics["lookahead_greedy_prefix_tokens"]))
    log.info("speed on %s (NOT phone speed when x86_emulator): TTFT %.0f ms, prefill %.2f tok/s, decode %.2f tok/s",
             backend.target.value, speed["ttft_ms"], speed["prefill_tok_s"], speed["decode_tok_s"])
