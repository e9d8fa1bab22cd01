"""The metric catalog: every metric a run, a sweep, a search or an analysis logs, with its header, its direction, its
unit and its label.

One entry per family: a name with a placeholder (`ppl_{phase}`, `time_{stage}_s`, `ddr_{ddr}_{graph}`) stands for
every metric it matches (the placeholders' vocabularies are PLACEHOLDERS). The report's table, the UI's runs view, the
search's objectives and the leaderboard read headers and directions from here, and the tracker checks every name it
logs against it: a name no entry matches is logged with a warning, and refused outright when QEXP_CHECK_METRICS=1
(the test suite sets it, so a new metric without its entry fails the test that logs it). CONTRIBUTING.md, "Adding a
metric", says what to write; docs/metrics.md is this catalog as a table (`python -m qexp.core.metrics`).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

log = logging.getLogger("qexp")

LOWER, HIGHER, NEITHER = "lower", "higher", ""  # which way is better
ESTIMATE = "estimate"  # a phone-speed figure computed by the speed model (qexp/speed), not measured
MEASURED = "measured"  # a timing of the program's target: x86_emulator on this host (NOT phone speed) or a phone

PHASES = "fp|qdq|deployed|fp_transformed"
PLACEHOLDERS: Dict[str, str] = {
    "phase": PHASES,
    "test": "qdq|deployed|fp_transformed",  # the changed side of a comparison
    "ref": "fp|qdq",  # the side it is compared with
    "graph": r"[a-z0-9_]+_forward(?:_shard\d+)?",  # a deployed program's graph (kv_forward, prefill_forward, ...)
    "stage": r"[a-z0-9_]+",  # a timed stage (qexp/core/timing.py)
    "ddr": "read_total_bytes|write_total_bytes|fill_bytes|spill_bytes",  # QNN's DDR bandwidth summary
    "sim": r"[a-z_]+",  # QNN's simulated cycles of an SA8797 graph
    "part": "decoder|embedding|lm_head",
    "task": r"[^.]+",  # an lm-eval task (a user's task may be named anything without a dot)
    "score": r"[^.]+?",  # an lm-eval metric of a task (acc, acc_norm, perplexity, ...)
    "budget": r"b\d+_\d+|\d{3,}",  # a sensitivity recipe's budget (qexp/sensitivity/run.py: budget_label)
    "view": "cost|gain",
    "op": "norms|softmaxes|sigmoids|gelus",
    "proxy": "sqnr|fisher",
    "status": r"[a-z]+",  # a sweep's job status
    "curve": "train_kd|train_ce|lr|val_kd|val_ce",
}


@dataclass(frozen=True)
class Metric:
    """One metric family. `name` may hold placeholders; `header` may use the same ones."""

    name: str
    header: str
    better: str = NEITHER
    unit: str = ""
    label: str = ""  # ESTIMATE or MEASURED: what a table must say beside the figure
    doc: str = ""

    @functools.cached_property
    def pattern(self) -> re.Pattern:
        parts = re.split(r"\{(\w+)\}", self.name)
        regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>{PLACEHOLDERS[p]})" for i, p in enumerate(parts))
        return re.compile(regex + r"\Z")



# The order matters where two families could match one name: the first entry that matches is the metric's.
CATALOG: List[Metric] = [
    # ---- accuracy: perplexities per phase (eval/perplexity.py), over the evaluation windows
    Metric("ppl_{phase}", "PPL {phase}", LOWER, doc="token perplexity over the evaluation windows"),
    Metric("word_ppl_{phase}", "word PPL {phase}", LOWER, doc="perplexity per word of the windows' text"),
    Metric("byte_ppl_{phase}", "byte PPL {phase}", LOWER, doc="perplexity per UTF-8 byte"),
    Metric("bits_per_byte_{phase}", "bits/byte {phase}", LOWER),
    Metric("nll_{phase}", "NLL {phase}", LOWER, "nats/token"),
    Metric("ppl_{phase}_sub", "PPL {phase} (deployed subset)", LOWER,
           doc="on the windows the deployed phase scored (its budget), for a paired comparison with it"),
    Metric("word_ppl_{phase}_sub", "word PPL {phase} (deployed subset)", LOWER),
    Metric("ppl_{test}_vs_{ref}", "Δ {test} vs {ref}", LOWER, "ratio - 1", doc="relative perplexity change"),
    Metric("ppl_{test}_vs_{ref}_ci_low", "Δ {test} vs {ref} 95% CI low", LOWER, "ratio - 1",
           doc="paired bootstrap over windows (eval/uncertainty.py)"),
    Metric("ppl_{test}_vs_{ref}_ci_high", "Δ {test} vs {ref} 95% CI high", LOWER, "ratio - 1"),
    Metric("ppl_{test}_vs_{ref}_ci_units", "Δ {test} vs {ref} CI units", NEITHER, "windows",
           doc="how many independent units the interval resamples"),
    Metric("top1_agreement_{test}_vs_{ref}", "top-1 {test} vs {ref}", HIGHER, "share",
           doc="share of positions whose most likely next token agrees"),
    Metric("logits_sqnr_db_{test}_vs_{ref}", "logits SQNR {test} vs {ref}", HIGHER, "dB"),
    Metric("deployed_eval_tokens", "deployed tokens scored", NEITHER, "tokens"),
    Metric("deployed_eval_windows", "deployed windows scored", NEITHER, "windows"),
    # ---- generation check (tasks/generation.py) and lm-eval tasks (tasks/harness.py)
    Metric("gen_prompts", "generation prompts", NEITHER, "prompts"),
    Metric("gen_identical_{test}", "generations identical to FP ({test})", HIGHER, "share"),
    Metric("gen_first_divergence_{test}", "first divergent token ({test})", HIGHER, "tokens"),
    Metric("gen_token_agreement_{test}", "generated tokens agreeing with FP ({test})", HIGHER, "share"),
    Metric("task.{task}.items", "{task} items", NEITHER, "items"),
    Metric("task.{task}.{score}_{test}_vs_{ref}_ci_low", "{task} {score} {test} vs {ref} 95% CI low"),
    Metric("task.{task}.{score}_{test}_vs_{ref}_ci_high", "{task} {score} {test} vs {ref} 95% CI high"),
    Metric("task.{task}.{score}_{test}_vs_{ref}", "{task} {score} {test} vs {ref}", NEITHER,
           doc="paired difference over the task's items"),
    Metric("task.{task}.{score}_{phase}", "{task} {score} {phase}", NEITHER,
           doc="an lm-eval metric; its direction is the task's (higher_is_better in lm-eval's task config)"),
    # ---- the program's size
    Metric("model_params", "parameters", NEITHER, "parameters"),
    Metric("weights_mb", "weights MB", LOWER, "MB", doc="the model's weights at the run's scheme (fp32 without one)"),
    Metric("weight_bits_decoder", "bits/weight (decoder)", LOWER, "bits",
           doc="per decoder-linear weight, scales included"),
    Metric("weight_bits_lm_head", "lm head bits", LOWER, "bits"),
    Metric("weight_bytes_streamed", "weight bytes per decode step", LOWER, "bytes"),
    Metric("weights_htp_{part}_mb", "{part} weights MB (HTP)", LOWER, "MB"),
    Metric("pte_bytes", ".pte bytes", LOWER, "bytes"),
    Metric("calibration_tokens", "calibration tokens", NEITHER, "tokens"),
    # ---- eval.htp_exact: the QDQ phase computed with HTP's arithmetic (quant/htp_arithmetic_pass.py)
    Metric("htp_exact_layers", "layers in HTP arithmetic", NEITHER, "layers"),
    Metric("htp_exact_{op}", "{op} in HTP arithmetic", NEITHER, "ops"),
    # ---- the compiled program (backends/htp): QNN's own accounts
    Metric("delegated_nodes_{graph}", "delegated nodes {graph}", NEITHER, "nodes"),
    Metric("non_delegated_nodes_{graph}", "nodes left on the CPU {graph}", LOWER, "nodes"),
    Metric("ddr_{ddr}_{graph}", "DDR {ddr} {graph}", LOWER, "bytes", doc="QNN's DDR bandwidth summary of the graph"),
    Metric("stream_bytes_{graph}", "bytes per call {graph} (counted)", LOWER, "bytes"),
    Metric("qnn_vs_counted_bytes_{graph}", "QNN vs counted bytes {graph}", NEITHER, "ratio"),
    Metric("htp_sim_{sim}_{graph}", "simulated {sim} {graph}", LOWER, "cycles",
           doc="QNN's compile-time simulation of an SA8797 graph (no phone figures: no time estimate)"),
    # ---- phone speed, estimated (qexp/speed): never measured here
    Metric("decode_tok_s_est", "decode tok/s (est.)", HIGHER, "tok/s", ESTIMATE),
    Metric("decode_tok_s_est_low", "decode tok/s 10% (est.)", HIGHER, "tok/s", ESTIMATE,
           doc="the 10-90% band of the speed model's held-out errors on published figures"),
    Metric("decode_tok_s_est_high", "decode tok/s 90% (est.)", HIGHER, "tok/s", ESTIMATE),
    Metric("decode_tok_s_est_err", "decode estimate's median error", NEITHER, "share", ESTIMATE,
           doc="leave-one-model-out median error of the speed model"),
    Metric("decode_ms_per_token_est", "decode ms/token (est.)", LOWER, "ms", ESTIMATE),
    Metric("decode_bytes_per_token_est", "bytes per decode step (est.)", LOWER, "bytes", ESTIMATE),
    Metric("prefill_tok_s_est", "prefill tok/s (est.)", HIGHER, "tok/s", ESTIMATE),
    Metric("ttft_ms_est", "TTFT ms (est.)", LOWER, "ms", ESTIMATE),
    Metric("ttft_ms_est_low", "TTFT ms 10% (est.)", LOWER, "ms", ESTIMATE),
    Metric("ttft_ms_est_high", "TTFT ms 90% (est.)", LOWER, "ms", ESTIMATE),
    Metric("ttft_ms_est_err", "TTFT estimate's median error", NEITHER, "share", ESTIMATE),
    Metric("ttft_ms_est_extrapolated", "TTFT estimate extrapolated", NEITHER, "flag", ESTIMATE,
           doc="1 when the model is outside the sizes the TTFT figures were fitted on"),
    # ---- speed, measured on the program's target (x86_emulator here: NOT phone speed)
    Metric("ttft_ms", "TTFT ms", LOWER, "ms", MEASURED),
    Metric("ttft_ms_p90", "TTFT ms p90", LOWER, "ms", MEASURED),
    Metric("decode_tok_s", "decode tok/s", HIGHER, "tok/s", MEASURED),
    Metric("decode_tok_s_p10", "decode tok/s p10", HIGHER, "tok/s", MEASURED),
    Metric("decode_tok_s_greedy", "decode tok/s (greedy)", HIGHER, "tok/s", MEASURED),
    Metric("decode_ms_per_token", "decode ms/token", LOWER, "ms", MEASURED),
    Metric("decode_ms_per_token_p90", "decode ms/token p90", LOWER, "ms", MEASURED),
    Metric("prefill_tok_s", "prefill tok/s", HIGHER, "tok/s", MEASURED),
    Metric("prefill_tok_s_p10", "prefill tok/s p10", HIGHER, "tok/s", MEASURED),
    Metric("decode_bytes_per_token", "bytes per decode step (XNNPACK)", LOWER, "bytes"),
    Metric("mem_bandwidth_gbs", "host memory bandwidth GB/s", NEITHER, "GB/s", MEASURED),
    Metric("decode_achieved_gbs", "decode GB/s achieved", HIGHER, "GB/s", MEASURED),
    Metric("decode_bw_efficiency", "decode share of bandwidth", HIGHER, "share", MEASURED),
    Metric("kv_update_us_per_token", "KV-cache update µs/token (host)", LOWER, "µs", MEASURED,
           doc="the emulator bench's KV-cache updates on this host (backends/htp/kv_cache.py), per decoded token"),
    Metric("kv_update_bytes_per_token", "KV-cache bytes written/token", LOWER, "bytes"),
    Metric("speed_repeats", "speed repeats", NEITHER, "runs"),
    Metric("threads", "CPU threads", NEITHER, "threads"),
    Metric("lookahead_steps", "lookahead decode calls", NEITHER, "calls"),
    Metric("lookahead_tokens_per_step", "tokens per lookahead call", HIGHER, "tokens"),
    Metric("lookahead_verified_tokens", "tokens accepted by verification", HIGHER, "tokens"),
    Metric("lookahead_greedy_prefix_tokens", "lookahead tokens equal to greedy", HIGHER, "tokens"),
    Metric("lookahead_matches_greedy", "lookahead lossless", HIGHER, "flag"),
    Metric("lookahead_decode_speedup", "lookahead speedup vs greedy", HIGHER, "ratio", MEASURED),
    # ---- cost of the run
    Metric("time_{stage}_s", "{stage} s", LOWER, "s",
           doc="wall time of a stage (qexp/core/timing.py); time_total_s: the run"),
    Metric("peak_rss_mb", "peak RSS MiB", LOWER, "MiB"),
    # ---- QAT (transforms/qat.py): summary and loss curves by step
    Metric("qat_{curve}", "QAT {curve}", LOWER, doc="a curve by step (the UI plots it)"),
    Metric("qat_steps", "QAT steps", NEITHER, "steps"),
    Metric("qat_steps_trained", "QAT steps trained", NEITHER, "steps"),
    Metric("qat_train_tokens", "QAT training tokens", NEITHER, "tokens"),
    Metric("qat_best_step", "QAT best step", NEITHER, "step"),
    Metric("qat_val_kd_start", "QAT validation KD at start", LOWER),
    Metric("qat_val_kd_best", "QAT validation KD, best", LOWER),
    Metric("qat_val_ce_start", "QAT validation CE at start", LOWER),
    Metric("qat_val_ce_best", "QAT validation CE, best", LOWER),
    Metric("qat_train_minutes", "QAT minutes", LOWER, "min"),
    Metric("qat_resumed_from_step", "QAT resumed from step", NEITHER, "step"),
    Metric("qat_trained_parameters", "QAT trained parameters", NEITHER, "parameters"),
    Metric("qat_latent_clamped_fraction", "QAT latent weights clamped", NEITHER, "share"),
    # ---- mixed-precision search (qexp/search): a trial, on the selection windows
    Metric("ppl_selection", "PPL (selection)", LOWER),
    Metric("ppl_fp_selection", "PPL FP (selection)", LOWER),
    Metric("ppl_vs_fp_selection", "Δ vs FP (selection)", LOWER, "ratio - 1"),
    Metric("ppl_vs_fp_selection_ci_low", "Δ vs FP (selection) 95% CI low", LOWER, "ratio - 1"),
    Metric("ppl_vs_fp_selection_ci_high", "Δ vs FP (selection) 95% CI high", LOWER, "ratio - 1"),
    Metric("bits", "bits/weight (decoder)", LOWER, "bits"),
    Metric("lm_head_bits", "lm head bits", LOWER, "bits"),
    Metric("promoted", "groups promoted", NEITHER, "groups"),
    Metric("weights_decoder_mb", "decoder weights MB", LOWER, "MB"),
    Metric("weights_lm_head_mb", "lm head weights MB", LOWER, "MB"),
    Metric("search_trials_finished", "trials finished", NEITHER, "trials"),
    Metric("search_front_size", "front size", NEITHER, "trials"),
    # ---- sensitivity analysis (qexp/sensitivity)
    Metric("selection_windows", "selection windows", NEITHER, "windows"),
    Metric("selection_window_len", "selection window length", NEITHER, "tokens"),
    Metric("selection_predicted_tokens", "selection tokens scored", NEITHER, "tokens"),
    Metric("ppl_all_high_selection", "PPL all layers high (selection)", LOWER),
    Metric("ppl_all_low_selection", "PPL all layers low (selection)", LOWER),
    Metric("analysis_s", "analysis s", LOWER, "s"),
    Metric("spearman_{view}_vs_{proxy}", "Spearman {view} vs {proxy}", HIGHER),
    Metric("spearman_cost_vs_gain", "Spearman cost vs gain", HIGHER),
    Metric("recipe_{budget}_bits", "recipe {budget} bits/weight", LOWER, "bits"),
    Metric("recipe_{budget}_lm_head_bits", "recipe {budget} lm head bits", LOWER, "bits"),
    Metric("recipe_{budget}_met", "recipe {budget} budget met", HIGHER, "flag"),
    Metric("recipe_{budget}_ppl_vs_fp_selection", "recipe {budget} Δ vs FP (selection)", LOWER, "ratio - 1"),
    Metric("recipe_{budget}_promoted", "recipe {budget} groups promoted", NEITHER, "groups"),
    # ---- a sweep's parent run (tracking/sweep.py)
    Metric("jobs_total", "jobs", NEITHER, "jobs"),
    Metric("jobs_{status}", "jobs {status}", NEITHER, "jobs"),
]


@functools.lru_cache(maxsize=None)
def lookup(name: str) -> Optional[Metric]:
    """The catalog's entry for a logged metric name (None: no entry)."""
    return next((metric for metric in CATALOG if metric.pattern.match(name)), None)


def header(name: str) -> str:
    """The table header of a metric name, its placeholders filled in (the name itself when the catalog has none)."""
    metric = lookup(name)
    if metric is None:
        return name
    return metric.header.format(**{k: _shown(k, v) for k, v in metric.pattern.match(name).groupdict().items()})


def _shown(placeholder: str, value: str) -> str:
    """A placeholder's value as a header shows it: FP and QDQ in capitals, a stage's words apart."""
    if placeholder in ("phase", "test", "ref") and value in ("fp", "qdq"):
        return value.upper()
    return value.replace("_", " ") if placeholder == "stage" else value


def better(name: str) -> str:
    """LOWER, HIGHER or NEITHER for a metric name."""
    metric = lookup(name)
    if metric is None:
        raise KeyError(f"{name!r} is not in the metric catalog (qexp/core/metrics.py)")
    return metric.better


class UnlistedMetricError(ValueError):
    pass


def check(names: Iterable[str]) -> None:
    """Every name must have an entry: warn (and refuse under QEXP_CHECK_METRICS=1, as the tests run)."""
    unlisted = sorted(name for name in names if lookup(name) is None)
    if not unlisted:
        return
    message = (f"metrics not in the catalog (qexp/core/metrics.py): {', '.join(unlisted)}; add an entry for each "
               "(CONTRIBUTING.md, 'Adding a metric')")
    if os.environ.get("QEXP_CHECK_METRICS") == "1":
        raise UnlistedMetricError(message)
    log.warning(message)


def markdown() -> str:
    """The catalog as a table (docs/metrics.md)."""
    rows = ["| metric | header | better | unit | label | what it is |", "|---|---|---|---|---|---|"]
    for metric in CATALOG:
        cells = (f"`{metric.name}`", metric.header, metric.better or "-", metric.unit or "-", metric.label or "-",
                 metric.doc or "")
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    placeholders = "\n".join(f"- `{{{name}}}`: `{regex}`" for name, regex in PLACEHOLDERS.items())
    return "\n".join(rows) + "\n\nPlaceholders (a regular expression each):\n\n" + placeholders + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
