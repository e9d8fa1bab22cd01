"""HTP speed without a phone: a per-SoC estimate of TTFT, prefill and decode tokens/s, fitted to published device
figures (docs/htp-speed.md).

Modules: published.yaml (the figures, their sources, the SoCs), data (them as objects), bytes (what a graph call
streams, from shapes and the quant config), ddr (QNN's own count, from a compiled graph), model (time of a graph
call), fit (parameters and leave-one-out errors), __main__ (`python -m qexp.speed`, the estimate of a config
without compiling).

Two entry points give a SpeedEstimate:
- `estimate_program(shapes, quant, meta, prompt_len)`: a compiled program (its meta.json), its bytes per decode step
  from QNN's DDR summary where the compile recorded one;
- `estimate_config(shapes, quant, soc, model_mode, context, prefill_ar_len, prompt_len)`: the same from the config
  alone (a what-if).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from qexp.speed.bytes import Shapes, StreamBytes, stream_bytes
from qexp.speed.model import SpeedEstimate

DECODE_GRAPH = "kv_forward"
PREFILL_GRAPH = "prefill_forward"


def _estimate(shapes: Shapes, decode: StreamBytes, prefill: Optional[StreamBytes], soc_name: str, context: int,
              prefill_ar_len: Optional[int], prompt_len: int) -> SpeedEstimate:
    from qexp.speed.fit import fitted

    fit = fitted()
    soc = fit.data.soc(soc_name)  # a SoC without figures: one clear error naming the known ones
    model = fit.model
    step = model.call_seconds(shapes, decode, soc, 1, context)
    if prefill is not None and prefill_ar_len:
        ttft = model.ttft_seconds(shapes, prefill, soc, prefill_ar_len, context, prompt_len)
    else:  # kv mode: the prompt token by token through the decode graph
        ttft = prompt_len * step
    (d_low, d_high), (t_low, t_high) = fit.band("decode"), fit.band("ttft")
    fitted_sizes = [p.point.shapes.linear_params() for p in fit.measured("ttft")]
    extrapolated = not min(fitted_sizes) <= shapes.linear_params() <= max(fitted_sizes)
    return SpeedEstimate(soc=soc_name, decode_tok_s=1 / step, decode_ms_per_token=1000 * step, ttft_ms=1000 * ttft,
                         prefill_tok_s=prompt_len / ttft, prompt_len=prompt_len, prefill_ar_len=prefill_ar_len,
                         decode_bytes=decode.total, decode_err=fit.error("decode", "median", "model"),
                         ttft_err=fit.error("ttft"), source=fit.source, decode_low=d_low / step,
                         decode_high=d_high / step, ttft_low=1000 * ttft * t_low, ttft_high=1000 * ttft * t_high,
                         ttft_extrapolated=extrapolated)


def model_shapes(model_cfg) -> Shapes:
    """A configured model's shapes from its metadata (no weight is loaded), or a ConfigError saying what to give."""
    from qexp.core.errors import ConfigError
    from qexp.models.shapes import model_dims

    dims = model_dims(model_cfg)
    needed = ("n_layers", "dim", "hidden_dim", "n_heads", "vocab_size")
    if dims is None or any(not dims.get(k) for k in needed):
        raise ConfigError(f"model={model_cfg.name}: its shapes cannot be read from its metadata",
                          "give model.path (a folder with config.json, or a GGUF file)")
    return Shapes.of(dims)


def weight_size_metrics(cfg) -> dict:
    """Bits per decoder-linear weight and the HTP storage of the weights (qexp/speed/bytes.py: weight_size), from
    the model's shapes and the quant config; none for a model whose metadata does not give its shapes."""
    from qexp.core.errors import ConfigError
    from qexp.speed.bytes import weight_size

    try:
        return weight_size(model_shapes(cfg.model), cfg.quant)
    except ConfigError:
        return {}


def check_soc(soc_name: str) -> None:
    """A ConfigError naming the SoCs with figures, for one without (reads the data file only)."""
    from qexp.speed.data import check_soc as check

    check(soc_name)


def estimate_config(shapes: Shapes, quant, soc: str, context: int, prefill_ar_len: Optional[int],
                    prompt_len: int) -> Tuple[SpeedEstimate, StreamBytes]:
    """The estimate of a config that is not compiled: bytes from shapes and the quant config. prefill_ar_len None:
    a kv-mode program (no AR-N graph). Returns the estimate and the decode step's bytes."""
    decode = stream_bytes(shapes, quant, context, 1)
    prefill = stream_bytes(shapes, quant, context, prefill_ar_len) if prefill_ar_len else None
    return _estimate(shapes, decode, prefill, soc, context, prefill_ar_len, prompt_len), decode


def qnn_stream_bytes(analytic: StreamBytes, ddr: Optional[dict]) -> Optional[StreamBytes]:
    """A graph call's bytes with QNN's count of what it reads (read_total_bytes of its DDR summary) in place of the
    analytic reads: the KV cache and the I/O as computed, the rest of QNN's reads as weights; the bytes written as
    computed (QNN's write_total_bytes also counts what it stages through DRAM, a few MB on SmolLM2, which the
    published figures the model is fitted to cannot tell apart). None without a summary."""
    if not ddr:
        return None
    reads_besides_weights = analytic.kv_cache + analytic.io - analytic.written
    return dataclasses.replace(analytic, weights=max(float(ddr["read_total_bytes"]) - reads_besides_weights, 0.0))


def estimate_program(shapes: Shapes, quant, meta: dict, prompt_len: int) -> Tuple[SpeedEstimate, str, dict]:
    """The estimate of a compiled HTP program from its meta.json: (estimate, where its bytes came from, the analytic
    and QNN byte counts of each graph for the run's metrics)."""
    context, graphs, kv_bits = int(meta["context"]), meta["graphs"], int(meta["kv_bits"])
    ddr = meta.get("ddr") or {}
    counts = {}
    for graph, ar_len in graphs.items():
        analytic = stream_bytes(shapes, quant, context, int(ar_len), kv_bits_override=kv_bits)
        counts[graph] = {"analytic": analytic, "qnn": qnn_stream_bytes(analytic, ddr.get(graph))}
    # QNN's counts for every graph, or none: one program's estimate never mixes the two
    source = "qnn_ddr_summary" if all(c["qnn"] is not None for c in counts.values()) else "shapes_and_scheme"
    chosen = {graph: c["qnn" if source == "qnn_ddr_summary" else "analytic"] for graph, c in counts.items()}
    prefill_ar = int(graphs[PREFILL_GRAPH]) if PREFILL_GRAPH in graphs else None
    # lookahead's decode graph verifies several tokens per call: its call is counted as one token (a floor)
    estimate = _estimate(shapes, chosen[DECODE_GRAPH], chosen.get(PREFILL_GRAPH), meta["soc"], context, prefill_ar,
                         prompt_len)
    return estimate, source, counts
