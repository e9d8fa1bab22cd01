"""The report's columns: name -> (MLflow column, header), the default table's and the extra ones, the metrics the CSV
keeps, and how a `--columns` list resolves. Metric headers are the metric catalog's (qexp/core/metrics.py)."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from qexp.core.metrics import header


def _metric(name: str) -> tuple[str, str]:
    return f"metrics.{name}", header(name)  # the header is the metric catalog's (qexp/core/metrics.py)


# column name -> (MLflow column, header); the default table, in the seeds' order
COLUMNS: Dict[str, tuple[str, str]] = {
    "model": ("params.model.name", "model"),
    "scheme": ("tags.scheme", "scheme"),
    "observer": ("params.observer.name", "observer"),
    "calibration": ("calibration", "calibration"),
    "kv_mode": ("kv_mode", "KV mode"),
    "backend": ("params.backend.name", "backend"),
    "target": ("target", "target"),
    "ppl_fp": _metric("ppl_fp"),
    "ppl_qdq": _metric("ppl_qdq"),
    "ppl_deployed": _metric("ppl_deployed"),
    "delta_vs_fp": ("delta_vs_fp", "Δ vs FP"),
    "ttft_ms": ("ttft_ms", "TTFT ms"),
    "decode_tok_s": ("decode_tok_s", "decode tok/s"),
    "speed_source": ("speed_source", "speed"),
    "pte_mb": ("pte_mb", ".pte MB"),
}
EXTRA_COLUMNS: Dict[str, tuple[str, str]] = {
    "model_mode": ("params.backend.model_mode", "model mode"),
    "soc": ("params.backend.soc", "SoC"),
    "weights_mb": _metric("weights_mb"),
    "weight_bits": _metric("weight_bits_decoder"),
    "lm_head_bits": _metric("weight_bits_lm_head"),
    "weights_htp_mb": _metric("weights_htp_decoder_mb"),
    "ppl_fp_sub": _metric("ppl_fp_sub"),
    "ppl_qdq_sub": _metric("ppl_qdq_sub"),
    "ppl_deployed_vs_qdq": _metric("ppl_deployed_vs_qdq"),
    "top1_deployed_vs_qdq": _metric("top1_agreement_deployed_vs_qdq"),
    "decoder": ("tags.decoder", "decoder"),
    "prefill_tok_s": ("prefill_tok_s", "prefill tok/s"),
    # the estimate's interval (speed model v4 on): the 10-90% band of its held-out errors on published figures
    "decode_tok_s_band": ("decode_tok_s_band", "decode tok/s 10-90% band (est.)"),
    # the x86 emulator's own timings of an HTP run (backend.bench.emulator=true), beside the estimate
    "ttft_ms_emulator": ("ttft_ms_emulator", "TTFT ms (x86_emulator)"),
    "decode_tok_s_emulator": ("decode_tok_s_emulator", "decode tok/s (x86_emulator)"),
    "run_id": ("run_id", "run"),
    "algorithm": ("algorithm", "algorithm"),
    "qdq_arithmetic": ("qdq_arithmetic", "QDQ arithmetic"),
}
# Metrics the CSV keeps even when not shown: the subset figures the notes point to.
CSV_METRICS = ("ppl_fp_sub", "ppl_qdq_sub", "ppl_deployed_vs_qdq", "top1_agreement_deployed_vs_qdq",
               "deployed_eval_tokens", "deployed_eval_windows", "weight_bits_decoder", "weight_bits_lm_head")
MIXED_COLUMNS = {"text_source": ("params.eval.text_source", "text"),
                 "window_len": ("params.eval.window_len", "window len"),
                 "n_windows": ("params.eval.n_windows", "windows")}


def resolve_columns(names: Optional[Sequence[str]]) -> Dict[str, tuple[str, str]]:
    if not names:
        return dict(COLUMNS)
    known = {**COLUMNS, **EXTRA_COLUMNS}
    out = {}
    for name in names:
        if name in known:
            out[name] = known[name]
        elif name.startswith("metrics."):
            out[name] = _metric(name.split(".", 1)[1])
        elif name.startswith(("params.", "tags.")):
            out[name] = (name, name.split(".", 1)[1])
        elif name.startswith("task.") and "_vs_" in name:  # a task delta: shown with its 95% interval
            out[name] = (f"metrics.{name}", f"Δ {name[len('task.'):]}")
        else:  # a bare metric name, e.g. ttft_ms_est_high
            out[name] = _metric(name)
    return out
