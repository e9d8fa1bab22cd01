"""Deploy phase (backend=htp): compile the calibrated model for a SoC, run it, score it on-target, time it.

On this machine the target is the x86_64 HTP emulator: every timing is tagged target=x86_emulator and measures
the emulator, not a phone. On-target perplexity uses a subset of the evaluation windows (the emulator is slow), and
the FP and QDQ phases are scored on exactly that subset too (`*_sub`), so the three are comparable.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Dict, Tuple

from qexp.cache import Cache
from qexp.config import ModelMode, Target
from qexp.errors import ConfigError, InputError
from qexp.evaluate import EvalResult, Windows, evaluate
from qexp.lower import KV_GRAPH, META_FILE, PREFILL_GRAPH, DeployedProgram, compile_pte, graph_ar_lens
from qexp.qnn_sdk import ensure_qnn_sdk
from qexp.timing import StageTimer

log = logging.getLogger("qexp")


def validate_htp(cfg) -> None:
    backend = cfg.backend
    if cfg.quant.scheme == "fp32":
        raise ConfigError("backend=htp needs a quantized scheme, not quant=fp32", "choose e.g. quant=16a8w")
    if backend.max_seq_len != cfg.export.max_context_len:
        raise ConfigError(
            f"backend.max_seq_len={backend.max_seq_len} differs from export.max_context_len="
            f"{cfg.export.max_context_len}, the context the model was calibrated for",
            "set both to the same value (backend.max_seq_len defaults to export.max_context_len)",
        )
    if not 1 <= backend.prefill_ar_len < backend.max_seq_len:
        raise ConfigError(f"backend.prefill_ar_len={backend.prefill_ar_len}", "use 1 <= prefill_ar_len < max_seq_len")
    from qexp.static_model import arch_flags

    r3 = arch_flags(cfg.model.arch)["r3"] if cfg.model.r3 is None else cfg.model.r3
    if r3 and cfg.model.recompose_hadamard:
        # QNN 2.49's HTP cannot build the rotation's HadamardTransform op in an AR-N graph (FIELD-NOTES), rejects it
        # below 16-bit activations, and the recomposition differs between AR lengths, so the calibration could not
        # be carried over to the deploy graphs either.
        raise ConfigError(
            "backend=htp with the R3 rotation lowered as QNN's HadamardTransform does not build with these QNN "
            "libraries",
            "set model.recompose_hadamard=false (the rotation stays a matmul: same weights, same math)",
        )
    decode_ar = graph_ar_lens(backend)[KV_GRAPH]
    if backend.model_mode == ModelMode.lookahead:
        if backend.ngram < 2 or backend.window < 1 or backend.gcap < 1:
            raise ConfigError(f"backend.ngram={backend.ngram}, window={backend.window}, gcap={backend.gcap}",
                              "lookahead needs ngram >= 2, window >= 1, gcap >= 1")
        if decode_ar >= backend.max_seq_len:
            raise ConfigError(
                f"lookahead's decode graph needs AR-{decode_ar} (next power of two of (window + gcap) * (ngram - 1)),"
                f" not less than max_seq_len={backend.max_seq_len}", "lower window/gcap/ngram")
    spare = backend.ngram if backend.model_mode == ModelMode.lookahead else 0  # a lookahead step may accept ngram
    if cfg.bench.prompt_len + cfg.bench.new_tokens + spare > backend.max_seq_len - decode_ar:
        raise ConfigError(
            f"bench.prompt_len + bench.new_tokens ({cfg.bench.prompt_len} + {cfg.bench.new_tokens}) does not fit the "
            f"decode graph's cache ({backend.max_seq_len - decode_ar} slots{' minus ngram' if spare else ''})",
            "shorten them")


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
    return DeployedProgram(pte, json.loads(meta_path.read_text()), key="pre-generated", cache_hit=True)


def htp_subset(windows: Windows, tokens: int, tokenizer) -> Windows:
    """Whole windows first; a budget below one window takes the first `tokens` tokens of window 0."""
    if tokens >= windows.seq_len:
        return windows.head(min(windows.n_windows, tokens // windows.seq_len), windows.seq_len, tokenizer)
    return windows.head(1, max(tokens, 2), tokenizer)


def runtime_tokenizer(model, cache: Cache) -> str:
    """The tokenizer file qnn_llama_runner reads: tokenizer.json (HF), tokenizer.bin (llama2c), tokenizer.model."""
    tokenizer = model.tokenizer
    if tokenizer.kind == "hf":
        return str(Path(tokenizer.path) / "tokenizer.json")
    if tokenizer.kind == "tiktoken":
        return tokenizer.path

    from qexp.cache import file_sha256

    def build(tmp: Path) -> dict:
        import subprocess
        import sys

        subprocess.run([sys.executable, "-m", "pytorch_tokenizers.tools.llama2c.convert", "-t", tokenizer.path,
                        "-o", str(tmp / "tokenizer.bin")], check=True, capture_output=True)
        return {}

    entry, _ = cache.get_or_build("tokenizer_bin", file_sha256(tokenizer.path)[:24], build)
    return str(entry / "tokenizer.bin")


def android_target(cfg, model, cache: Cache, adb=None):
    from executorch.examples.qualcomm.oss_scripts.llama.decoder_constants import DECODER_MODEL_VERSION

    from qexp.android import AndroidTarget

    target = AndroidTarget(cfg.backend, "", DECODER_MODEL_VERSION.get(cfg.model.arch, "llama3"), adb=adb)
    target.check()  # before any compile: a missing adb / device / runner is one line, not minutes later
    target.runtime_tokenizer = runtime_tokenizer(model, cache)
    return target


def run_htp_phase(
    cfg, model, static, qdq_model, windows: Windows, fp: EvalResult, qdq: EvalResult, cache: Cache,
    timer: StageTimer, versions: dict, adb=None,
) -> Tuple[Dict[str, float], Dict[str, str]]:
    from qexp.htp_runner import HtpRunner, lookahead_layout, measure_speed, verify_lookahead

    backend = cfg.backend
    metrics: Dict[str, float] = {}
    device = android_target(cfg, model, cache, adb) if backend.target == Target.android else None
    sdk = ensure_qnn_sdk(cache)
    tags = {"target": backend.target.value, "version.qnn_libs": sdk.version, "htp_soc": backend.soc.value,
            "htp_model_mode": backend.model_mode.value, "kv_update": cfg.kv.updater.value}

    with timer.stage("compile"):
        if backend.pte_path:
            program = load_program(backend.pte_path)
        else:
            program = compile_pte(model, cfg, qdq_model, static.r3, cache, timer, versions)
    tags.update({"pte_cache_key": program.key, "pte_cache_hit": str(program.cache_hit).lower()})
    metrics["pte_bytes"] = program.pte_bytes
    for graph, counts in program.meta["delegation"].items():
        metrics[f"delegated_nodes_{graph}"] = counts["delegated"]
        metrics[f"non_delegated_nodes_{graph}"] = counts["non_delegated"]
    if device is not None:
        return _run_on_device(cfg, model, program, device, windows, fp, qdq, timer, metrics, tags)
    runner = HtpRunner(program)

    # ---- on-target perplexity, on a subset scored identically by every phase
    if PREFILL_GRAPH in program.meta["graphs"]:
        path, reason, budget = "prefill", f"AR-{program.meta['graphs'][PREFILL_GRAPH]} prefill graph", cfg.eval.htp_tokens
        logits_fn = runner.prefill_logits
    else:
        path, reason, budget = "kv", "model_mode=kv compiles no AR-N graph", cfg.eval.htp_kv_tokens
        logits_fn = lambda ids: runner.kv_logits(ids, cfg.kv.updater.value)[0]  # noqa: E731
    subset = htp_subset(windows, budget, model.tokenizer)
    fp_sub, qdq_sub = fp.head(subset), qdq.head(subset)
    with timer.stage("eval_htp"):
        htp = evaluate(logits_fn, subset, "HTP", reference=qdq_sub)
    tags.update({"htp_eval_path": path, "htp_eval_path_reason": reason})
    _subset_metrics(metrics, htp, fp_sub, qdq_sub, subset)
    log.info("HTP (%s, %s): ppl %.3f vs QDQ %.3f on the same %d tokens (%+.2f%%), top-1 agreement %.3f",
             backend.target.value, path, metrics["ppl_htp"], metrics["ppl_qdq_sub"], subset.n_predicted,
             100 * metrics["ppl_htp_vs_qdq"], metrics["top1_agreement_htp_vs_qdq"])

    # ---- speed, labelled with its target
    prompt = [int(t) for t in windows.ids[0][: cfg.bench.prompt_len]]
    lookahead = lookahead_layout(runner, backend) if backend.model_mode == ModelMode.lookahead else None
    tags["decoder"] = "greedy" if lookahead is None else "lookahead"
    with timer.stage("bench_htp"):
        speed, tokens = measure_speed(runner, prompt, cfg.bench.new_tokens, cfg.kv.updater.value, cfg.bench.warmup,
                                      cfg.bench.repeats, lookahead)
    metrics.update({k: v for k, v in speed.items() if not (isinstance(v, float) and math.isnan(v))})
    if lookahead is not None:  # lossless? the same prompt decoded greedily through the same graph, one token per call
        with timer.stage("verify_lookahead"):
            metrics.update(verify_lookahead(runner, prompt, tokens, cfg.kv.updater.value))
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
    return metrics, tags


def _subset_metrics(metrics: dict, htp: EvalResult, fp_sub: EvalResult, qdq_sub: EvalResult, subset: Windows) -> None:
    metrics.update({f"{k}_htp": v for k, v in htp.metrics().items()})
    metrics.update({f"{k}_fp_sub": v for k, v in fp_sub.metrics().items() if k in ("ppl", "word_ppl")})
    metrics.update({f"{k}_qdq_sub": v for k, v in qdq_sub.metrics().items() if k in ("ppl", "word_ppl")})
    metrics["ppl_htp_vs_qdq"] = metrics["ppl_htp"] / metrics["ppl_qdq_sub"] - 1.0
    metrics["top1_agreement_htp_vs_qdq"] = htp.extras["top1_agreement"]
    metrics["htp_eval_tokens"] = subset.n_predicted
    metrics["htp_eval_windows"] = subset.n_windows


def _run_on_device(cfg, model, program, device, windows, fp, qdq, timer, metrics, tags):
    """Same metrics as the emulator path, measured by the phone's qnn_llama_runner (target=android)."""
    with timer.stage("deploy_android"):
        device.deploy(program.pte_path)
    first = next(iter(program.meta["encodings"].values()))
    scale, zero_point = first["logits"]
    vocab = model.params["vocab_size"]
    subset = htp_subset(windows, cfg.eval.htp_tokens, model.tokenizer)
    fp_sub, qdq_sub = fp.head(subset), qdq.head(subset)
    with timer.stage("eval_htp"):
        htp = evaluate(lambda ids: device.logits(ids, vocab, scale, zero_point), subset, "HTP", reference=qdq_sub)
    tags.update({"htp_eval_path": "device_kv", "htp_eval_path_reason": "qnn_llama_runner --dump_logits_path"})
    _subset_metrics(metrics, htp, fp_sub, qdq_sub, subset)
    prompt_text = model.tokenizer.decode(windows.ids[0][windows.first_target : cfg.bench.prompt_len])
    with timer.stage("bench_htp"):
        metrics.update(device.speed(prompt_text, cfg.backend.model_mode.value, cfg.backend.max_seq_len))
    return metrics, tags
