"""The stages of a run (qexp/pipeline.py orders them). Each reads what earlier stages left on the RunState, calls
the module that does the work, and records what it produced: metrics, tags, params and artifacts."""

from __future__ import annotations

import logging
import os

import numpy as np

from qexp.backends import QdqPhase
from qexp.deploy_stage import deploy, tasks
from qexp.core.device import on_device
from qexp.core.errors import InputError
from qexp.eval.compare import compare, phase_metrics
from qexp.core.provenance import fp_eval_key, qdq_cache_key

log = logging.getLogger("qexp")

SQNR_WINDOWS = 2  # windows whose full logits are compared between phases


def load(state) -> None:
    from qexp.models.sources import load_model
    from qexp.models.static_llama import StaticLlama
    from qexp.quant.encodings import weights_megabytes
    from qexp.quant.recipe import check_block_sizes, check_overrides_match

    cfg = state.cfg
    with state.timer.stage("load"):
        model = load_model(cfg.model, state.cache)
        if model.max_context and cfg.eval.seq_len > model.max_context:
            raise InputError(
                f"eval.seq_len={cfg.eval.seq_len} is larger than the model's context ({model.max_context} tokens)",
                "lower eval.seq_len")
        shapes = {k: tuple(v.shape) for k, v in model.state_dict.items()}
        check_block_sizes(cfg.quant, shapes)
        check_overrides_match(cfg.quant, shapes)
        state.model = model
        state.fp_static = StaticLlama.for_model_config(model, cfg.export.max_context_len, cfg.model)
    state.tags.update({"model_sha256": model.fingerprint, "model_source": model.source_path,
                       "r3": str(state.fp_static.r3), "masked_softmax": str(state.fp_static.masked_softmax)})
    state.metrics["model_params"] = model.n_params
    state.metrics["weights_mb"] = weights_megabytes(state.fp_static.module)  # fp32; the QDQ phase replaces it


def scored(state, module, static, desc: str, keep_logits: int = 0):
    """The run's windows through `module` (a float static llama or a QDQ program) on the run's device."""
    from qexp.eval.perplexity import evaluate
    from qexp.models.static_llama import window_logits

    return on_device(state.device, module, lambda placed: evaluate(
        lambda ids: window_logits(placed, static, ids, state.device), state.windows, desc, keep_logits=keep_logits))


def _check_token_ids(ids, model) -> None:
    """Token ids the tokenizer produced must index the model's embedding. A tokenizer's length may exceed the table
    (unused added special tokens, as transformers' Qwen2 tokenizer adds); an id that does is a tokenizer that does not
    belong to the weights."""
    rows = model.state_dict["tok_embeddings.weight"].shape[0]
    largest = int(ids.max()) if ids.size else -1
    if largest >= rows:
        raise InputError(
            f"the tokenizer produced token id {largest} but the model's embedding has {rows} rows",
            "the tokenizer and the weights do not belong together: pass the model's own tokenizer",
        )


def text(state) -> None:
    from qexp.data.text import load_corpus
    from qexp.data.windows import make_windows

    cfg, model = state.cfg, state.model
    with state.timer.stage("text"):
        corpus = load_corpus(cfg.text, state.cache)
        windows = make_windows(corpus.joined("test"), model.tokenizer, cfg.eval.seq_len, cfg.eval.limit, model.add_bos)
        _check_token_ids(windows.ids, model)
    state.corpus, state.windows = corpus, windows
    state.tags.update({
        "text_source": corpus.source,
        "text_sha256": corpus.sha256,
        "text_comparable_to_wikitext2": str(corpus.comparable_to_wikitext2).lower(),
        "eval_windows_sha256": windows.sha256,
    })
    state.log_params({
        "eval.text_source": corpus.source,
        "eval.window_len": windows.seq_len, "eval.n_windows": windows.n_windows,
        "eval.predicted_tokens": windows.n_predicted,
        "text.test_chars": corpus.n_chars["test"],
        "text.calibration_chars": corpus.n_chars["calibration"],
    })
    state.log_array(windows.ids, "eval/windows.npy")
    # Name and digest say which text and which windows: runs on different text differ in the UI's Dataset column.
    state.log_dataset(windows.ids, f"{corpus.source}:test", windows.sha256, corpus.location, "evaluation",
                      windows=f"{windows.n_windows} x {windows.seq_len} tokens", text_sha256=corpus.sha256[:16])


def fp(state) -> None:
    from qexp.eval.perplexity import cached_evaluation

    static, windows = state.fp_static, state.windows
    with state.timer.stage("eval_fp"):
        # Shared by every run of this model on these windows (a sweep evaluates FP once).
        key = fp_eval_key(state.cfg, state.model, static, windows, SQNR_WINDOWS)
        result, hit = cached_evaluation(state.cache, key, windows,
                                        lambda: scored(state, static.module, static, "FP", SQNR_WINDOWS))
    state.fp = result
    state.tags["fp_eval_cache_hit"] = str(hit).lower()
    state.metrics.update(phase_metrics(result, "fp"))
    log.info("FP:  ppl %.3f  word_ppl %.3f  bits/byte %.4f", state.metrics["ppl_fp"], state.metrics["word_ppl_fp"],
             state.metrics["bits_per_byte_fp"])
    state.per_window.update({"window": np.arange(windows.n_windows), "words": windows.words, "bytes": windows.bytes,
                             "ll_fp": result.logprobs.sum(axis=1)})


def calibration(state) -> None:
    from qexp.data.calibration import build_calibration, check_disjoint
    from qexp.data.text import calibration_corpus
    from qexp.transforms import check_fitted_disjoint

    transforms = state.transforms
    if not (state.quantized or any(t.needs_calibration for t in transforms)):
        return
    cfg, model = state.cfg, state.model
    with state.timer.stage("calibration_data"):
        # calibration.text: another text's calibration half (domain shift); null = the evaluation text's
        corpus = calibration_corpus(cfg.text, cfg.calibration.text, state.corpus, state.cache)
        state.calibration = build_calibration(cfg.calibration, corpus, model.tokenizer, model.add_bos,
                                              cfg.export.max_context_len)
        check_disjoint(state.calibration, state.windows)  # also across texts: no shared token run with the windows
        check_fitted_disjoint(transforms, cfg, model, state.cache, state.windows)  # QAT's text
    calibration = state.calibration
    state.tags["calibration_sha256"] = calibration.sha256
    state.metrics["calibration_tokens"] = calibration.n_tokens
    if cfg.calibration.kind.name == "wikitext":
        state.tags.update({"calibration_text_source": corpus.source, "calibration_text_sha256": corpus.sha256})
        state.log_params({"calibration.text_source": corpus.source})
    tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in calibration.samples])
    name, source = _calibration_dataset(cfg.calibration, corpus)
    state.log_dataset({"input_ids": tokens}, name, calibration.sha256, source, "calibration",
                      samples=len(calibration.samples), tokens=calibration.n_tokens,
                      description=calibration.description)


def _calibration_dataset(cfg, corpus) -> tuple:
    """The calibration set's (name, source): `gensim-enwiki-excerpt:calibration`, `prompts`, `chat:<file>`."""
    from qexp.data.calibration import BUILTIN_CHATS

    kind = cfg.kind.name
    if kind == "wikitext":
        return f"{corpus.source}:calibration", corpus.location
    if kind == "prompt":
        return "prompts", "config:calibration.prompts"
    path = cfg.chat_path or BUILTIN_CHATS
    return f"chat:{os.path.basename(path)}", str(path)


def transform(state) -> None:
    """Apply the `algorithm` transforms to the float model; every later stage uses the result. A transform that
    preserves the function must leave the float perplexity unchanged: `ppl_fp_transformed` shows it."""
    from qexp.eval.perplexity import cached_evaluation
    from qexp.models.static_llama import StaticLlama
    from qexp.tracking.curves import CurveLog
    from qexp.transforms import algorithm_label, model_transforms

    transforms = model_transforms(state.transforms)
    if not transforms:
        state.deploy_model, state.deploy_static = state.model, state.fp_static
        return
    curves = CurveLog() if state.tracked else None  # logs a training's curves as it trains, the rest once done
    model, context = apply_algorithms(state, transforms, curves)
    for outputs in context.outputs.values():
        _log_transform_outputs(state, outputs, curves)
    state.tags.update({f"transform_cache_hit.{name}": str(hit).lower() for name, hit in context.cache_hits.items()})
    static = StaticLlama.for_model_config(model, state.cfg.export.max_context_len, state.cfg.model)
    with state.timer.stage("eval_fp_transformed"):
        # its fingerprint covers every transform's settings, calibration and grid: a sweep over schemes scores it once
        key = fp_eval_key(state.cfg, model, static, state.windows, 0)
        result, hit = cached_evaluation(state.cache, key, state.windows,
                                        lambda: scored(state, static.module, static, "FP transformed"))
    state.tags["fp_transformed_eval_cache_hit"] = str(hit).lower()
    state.deploy_model, state.deploy_static = model, static
    state.metrics.update({"ppl_fp_transformed": result.metrics()["ppl"],
                          **compare(result, state.fp, "fp_transformed", "fp")})
    state.tags.update({"algorithm": algorithm_label(transforms), "model_sha256_transformed": model.fingerprint})
    log.info("transforms %s: float ppl %.4f (untransformed %.4f)", ",".join(model.transforms),
             state.metrics["ppl_fp_transformed"], state.metrics["ppl_fp"])


def apply_algorithms(state, transforms: list, progress=None):
    """`transforms` applied to the run's float model with its calibration, cache, timer and device (each cached
    where it is cacheable) -> (the model, the TransformContext with what each reported)."""
    from qexp.transforms import TransformContext, apply_transforms

    context = TransformContext(state.cfg, state.calibration, state.cache, state.timer, reference=state.model,
                               reference_static=state.fp_static, progress=progress, device=state.device)
    return apply_transforms(state.model, transforms, context), context


def _log_transform_outputs(state, outputs: dict, curves) -> None:
    """What a transform reports about itself (QAT: loss curves by step, its training text, summary metrics)."""
    state.metrics.update(outputs.get("metrics", {}))
    state.tags.update(outputs.get("tags", {}))
    if curves is not None and outputs.get("metric_history"):
        curves(outputs["metric_history"])
    dataset = outputs.get("dataset")
    if dataset:
        state.log_dataset({"input_ids": np.asarray(dataset["ids"])}, dataset["name"], dataset["digest"],
                          state.corpus.location if state.corpus is not None else "", dataset["context"],
                          **dataset.get("tags", {}))


def qdq(state) -> None:
    from qexp.offload import float_weights_on_disk
    from qexp.quant.calibrate import quantize
    from qexp.quant.encodings import encodings_table, summarize_encodings, weights_megabytes
    from qexp.quant.fold import with_weights_dequantized
    from qexp.quant.grid import grid_tags
    from qexp.quant.htp_arithmetic_pass import MODELLED_OPS
    from qexp.quant.w4_lowering import htp_exact_lowering
    from qexp.transforms import algorithm_label, calibration_algorithms
    from qexp.speed import weight_size_metrics

    if not state.quantized:
        return
    cfg, static, soc = state.cfg, state.deploy_static, state.backend.quantizer_soc(state.cfg)
    algorithms = calibration_algorithms(state.transforms)
    key = qdq_cache_key(cfg, state.deploy_model, static, state.calibration, soc,
                        [a.fingerprint() for a in algorithms], state.device)
    with state.timer.stage("quantize"):
        program = quantize(static, cfg.quant, cfg.observer, state.calibration, state.cache, key, soc,
                           timer=state.timer, recompose_hadamard=cfg.model.recompose_hadamard,
                           algorithms=algorithms, device=state.device)
    state.tags.update({"qdq_cache_key": key, "qdq_cache_hit": str(program.cache_hit).lower(), **grid_tags(cfg)})
    if cfg.algorithm:  # every algorithm of the run in config order (the transform stage tags only model transforms)
        state.tags["algorithm"] = algorithm_label(state.transforms)
    lowering = htp_exact_lowering(cfg)
    state.tags["qdq_arithmetic"] = "fake_quant" if lowering is None else "htp_exact"
    # the float model waits on disk meanwhile (it is not read): a 1B model's 6 GB not held twice (qexp/offload.py)
    with state.timer.stage("eval_qdq"), float_weights_on_disk(state, program.module):
        # bit-identical, without dequantizing weights every window (plus HTP's integer arithmetic with eval.htp_exact)
        folded = with_weights_dequantized(program.module, lowering)
        if lowering is not None:
            log.info("QDQ arithmetic htp_exact (4-bit per-channel lowering %s): %s", lowering,
                     folded.htp_counts.describe())
            counts = folded.htp_counts
            state.metrics.update({"htp_exact_layers": counts.modelled, **{
                f"htp_exact_{name}": getattr(counts, name) for name in ("norms", "softmaxes", "sigmoids", "gelus")}})
            state.tags["htp_exact_model"] = MODELLED_OPS  # runs before norms were modelled have no such tag
        result = scored(state, folded, static, "QDQ", SQNR_WINDOWS)
        del folded
    state.qdq = QdqPhase(program, result, static, static.r3)
    metrics = state.metrics
    metrics.update({**phase_metrics(result, "qdq"), **compare(result, state.fp, "qdq", "fp")})
    log.info("QDQ: ppl %.3f (%+.2f%% vs FP, 95%% interval [%+.2f, %+.2f])  word_ppl %.3f  logits SQNR %.1f dB",
             metrics["ppl_qdq"], 100 * metrics["ppl_qdq_vs_fp"],
             100 * metrics.get("ppl_qdq_vs_fp_ci_low", float("nan")),
             100 * metrics.get("ppl_qdq_vs_fp_ci_high", float("nan")), metrics["word_ppl_qdq"],
             metrics["logits_sqnr_db_qdq_vs_fp"])
    state.per_window["ll_qdq"] = result.logprobs.sum(axis=1)
    table = encodings_table(program.module)
    metrics["weights_mb"] = weights_megabytes(static.module, table)
    metrics.update(weight_size_metrics(state.cfg))  # the report's size axis: one measure for every row
    state.log_text(table.to_csv(index=False), "quant/encodings.csv")
    state.log_text(summarize_encodings(table), "quant/summary.txt")


STAGE_FUNCTIONS = {"load": load, "text": text, "fp": fp, "calibration": calibration, "transform": transform,
                   "qdq": qdq, "tasks": tasks, "deploy": deploy}
