"""HTP backend (Qualcomm Hexagon NPU): compile the calibrated model for a SoC, run it on the x86 emulator or a
phone, score it on-target and time it. Modules: config (settings), lower (graphs -> .pte), runner (the .pte through
the pybindings), kv_cache (the two KV updaters), lookahead (decoding), android (adb), qnn_sdk (QNN libraries),
phase (the phase the pipeline runs)."""

from __future__ import annotations

import logging
import math

from qexp.backends.base import Backend, PhaseInputs, PhaseResult
from qexp.backends.htp.config import HtpConfig, ModelMode
from qexp.backends.registry import register_backend
from qexp.core.config import FLOAT_ACTIVATION_SCHEME, KV_8BIT_ANNOTATION, NO_QUANT
from qexp.core.errors import ConfigError

log = logging.getLogger("qexp")


@register_backend
class HtpBackend(Backend):
    name = "htp"
    config_class = HtpConfig

    def quantizer_soc(self, cfg) -> str:
        return cfg.backend.soc.value

    def validate(self, cfg) -> None:
        from qexp.backends.htp.lower import KV_GRAPH, graph_ar_lens
        from qexp.backends.htp.sharding import check_num_sharding
        from qexp.models.shapes import linear_shapes
        from qexp.models.static_llama import uses_r3

        backend, bench = cfg.backend, cfg.backend.bench
        if cfg.quant.scheme == NO_QUANT:
            raise ConfigError("backend=htp needs a quantized scheme, not quant=fp32", "choose e.g. quant=16a8w")
        if cfg.quant.scheme == FLOAT_ACTIVATION_SCHEME:
            # the deploy graphs tie each KV cache's input encoding to its output's and tag integer I/O; float16
            # caches and logits need float I/O, which qexp's lowering does not build yet (measured: StopIteration
            # looking for the caches' observers)
            raise ConfigError("quant=fp16a8w reaches the QDQ phase only: qexp's HTP graphs have integer KV-cache "
                              "and logits I/O, and float16 activations need float ones", "use backend=none")
        if backend.max_seq_len != cfg.export.max_context_len:
            raise ConfigError(
                f"backend.max_seq_len={backend.max_seq_len} differs from export.max_context_len="
                f"{cfg.export.max_context_len}, the context the model was calibrated for",
                "set both to the same value (backend.max_seq_len defaults to export.max_context_len)",
            )
        if not 1 <= backend.prefill_ar_len < backend.max_seq_len:
            raise ConfigError(f"backend.prefill_ar_len={backend.prefill_ar_len}",
                              "use 1 <= prefill_ar_len < max_seq_len")
        if uses_r3(cfg.model) and cfg.model.recompose_hadamard:
            # QNN 2.49's HTP cannot build the rotation's HadamardTransform op in an AR-N graph (`could not create op:
            # q::ConvLayer_s1.opt`), rejects it below 16-bit activations, and the recomposition differs between AR
            # lengths, so the calibration could not be carried over to the deploy graphs either.
            raise ConfigError(
                "backend=htp with the R3 rotation lowered as QNN's HadamardTransform does not build with these QNN "
                "libraries",
                "set model.recompose_hadamard=false (the rotation stays a matmul: same weights, same math)",
            )
        _check_lpbq_block_sizes(cfg.quant)
        _check_one_kv_cache_width(cfg.quant)
        _warn_without_speed_figures(backend.soc.value)
        shapes = linear_shapes(cfg.model)  # None when the metadata does not say; the lowering checks again
        check_num_sharding(backend.num_sharding,
                           sum(1 for k in shapes if k.endswith("attention.wq.weight")) if shapes else None)
        decode_ar = graph_ar_lens(backend)[KV_GRAPH]
        if backend.model_mode == ModelMode.lookahead:
            if backend.ngram < 2 or backend.window < 1 or backend.gcap < 1:
                raise ConfigError(f"backend.ngram={backend.ngram}, window={backend.window}, gcap={backend.gcap}",
                                  "lookahead needs ngram >= 2, window >= 1, gcap >= 1")
            if decode_ar >= backend.max_seq_len:
                raise ConfigError(
                    f"lookahead's decode graph needs AR-{decode_ar} (next power of two of (window + gcap) * "
                    f"(ngram - 1)), not less than max_seq_len={backend.max_seq_len}", "lower window/gcap/ngram")
        spare = backend.ngram if backend.model_mode == ModelMode.lookahead else 0  # a lookahead step may accept ngram
        if bench.prompt_len + bench.new_tokens + spare > backend.max_seq_len - decode_ar:
            raise ConfigError(
                f"backend.bench.prompt_len + new_tokens ({bench.prompt_len} + {bench.new_tokens}) does not fit the "
                f"decode graph's cache ({backend.max_seq_len - decode_ar} slots{' minus ngram' if spare else ''})",
                "shorten them")

    def scoring_hint(self, qdq_arithmetic, metrics: dict):
        return htp_exact_hint(qdq_arithmetic, metrics)

    def run(self, inputs: PhaseInputs) -> PhaseResult:
        from qexp.backends.htp.phase import run_phase

        return run_phase(inputs)

    def task_scorer(self, inputs: PhaseInputs):
        from qexp.backends.htp.phase import task_scorer

        return task_scorer(inputs)


def htp_exact_hint(qdq_arithmetic, metrics: dict):
    """One line for a user whose HTP run departs from the fake-quant QDQ program by more than the interval allows:
    the QDQ phase can compute what HTP computes instead (on Gemma-3-270M the fake-quant program was 7-15% optimistic
    and eval.htp_exact within ~1% of HTP). None otherwise."""
    low, high = metrics.get("ppl_deployed_vs_qdq_ci_low"), metrics.get("ppl_deployed_vs_qdq_ci_high")
    if qdq_arithmetic != "fake_quant" or low is None or high is None or not (
            math.isfinite(low) and math.isfinite(high)) or low <= 0 <= high:
        return None
    return (f"HTP departs from the fake-quant QDQ program by {100 * metrics['ppl_deployed_vs_qdq']:+.2f}%, beyond its "
            f"interval: eval.htp_exact=true scores the QDQ phase with the arithmetic HTP runs (16-bit norms floored, "
            f"the convolutions' accumulator; docs/htp-arithmetic.md)")




def _warn_without_speed_figures(soc: str) -> None:
    """A SoC without published speed figures still compiles and scores; the run says up front that it will log no
    speed estimate (qexp/speed)."""
    from qexp.speed import check_soc

    try:
        check_soc(soc)
    except ConfigError as exc:
        log.warning("this run will log no phone speed estimate: %s", exc)


def _check_one_kv_cache_width(quant) -> None:
    """Every KV cache of an HTP program must have one bit width: upstream's I/O tagging (and its phone runner) give
    all caches one type, and qexp's runner writes each output back into its input unchanged. The v cache is the v
    projection's output, so an override giving attention.wv other activation bits than the scheme's (the k cache,
    written after RoPE, keeps the scheme's) mixes them: measured on the tiny model, 16a8w with wv at 8a8w compiled
    and returned garbage (top-1 agreement with QDQ 0.000), 8a8w with wv at 16a8w aborted the emulator. The lowering
    checks the graph itself again (lower.check_one_kv_cache_width) for whatever this prediction misses."""
    from qexp.quant.grid import activation_bits, activation_bits_for

    if KV_8BIT_ANNOTATION in quant.custom_annotations:  # every cache at 8 bits whatever the projections get
        return
    scheme_bits = activation_bits(quant.scheme)
    for i in range(256):  # layer indices, so that a layer-range override (layers\.[0-3]\.) counts
        bits = activation_bits_for(quant, f"layers.{i}.attention.wv.weight")
        if bits != scheme_bits:
            raise ConfigError(
                f"backend=htp: an override gives attention.wv {bits}-bit activations (layer {i}), so the v cache "
                f"would be {bits}-bit beside {scheme_bits}-bit k caches, and HTP programs take one KV cache type",
                f"give attention.wv {scheme_bits}-bit activations (e.g. an override with scheme "
                f"{scheme_bits}a8w), or every cache 8 bits (quant.custom_annotations=[{KV_8BIT_ANNOTATION}])")


# LPBQ block sizes this QNN SDK's x86 HTP emulator runs correctly. Block 64 segfaults it (`thr_hvx` in
# libQnnHtp.so while running AWQ + 16a4w_block/64 on SmolLM2, and on a one-layer probe); blocks 48 and 144 return
# garbage on that probe. Verified: 32 (upstream's Llama recipe) and 16 (its Qwen recipe) on the one-layer
# probe (diagnostics/diag_htp_weight_bits.py --block-size N: SmolLM2's layer-0 gate and down projections, 83.9-84.4 dB
# HTP vs QDQ, as 16a8w's 86 dB) and by tests/test_htp_w4.py::test_lpbq_block_sizes_htp_accepts_run_faithfully.
HTP_LPBQ_BLOCK_SIZES = (16, 32)


def _check_lpbq_block_sizes(quant) -> None:
    from qexp.core.config import BlockScaleRounding, Granularity

    sizes = {quant.block_size} if quant.weight_granularity == Granularity.per_block else set()
    sizes |= {o.block_size for o in quant.overrides if o.granularity == Granularity.per_block}
    if sizes and quant.block_scale_rounding == BlockScaleRounding.float:
        log.warning("quant.block_scale_rounding=float: HTP's lowering re-quantizes the block scales to 4-bit steps "
                    "(qexp/quant/lpbq.py), so the HTP phase will not run what the QDQ phase scored")
    bad = sorted(sizes - set(HTP_LPBQ_BLOCK_SIZES))
    if bad:
        raise ConfigError(
            f"backend=htp with LPBQ block_size={bad[0]}: this QNN SDK's HTP emulator crashes or returns garbage for "
            f"it (block 64 segfaults libQnnHtp.so)",
            f"use quant.block_size={' or '.join(map(str, HTP_LPBQ_BLOCK_SIZES))} for HTP, or backend=none for the QDQ "
            f"phase only")
