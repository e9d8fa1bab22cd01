"""The speed model: how long one call of a deployed HTP graph takes on a SoC, from the bytes it streams and the
work it does. Its parameters are fitted to published device figures (qexp/speed/fit.py).

One call of a graph (decode: AR-1; prefill: one chunk of AR-N tokens) costs

    fixed + max(memory, compute)
    fixed   = head_ops * head_op_us / relative_compute
    memory  = bytes / (bandwidth_efficiency * peak_gbs * relative_compute ** compute_exponent * genie_speedup ** genie)
              + kv_extra * kv_cache_bytes * heads / kv_heads / peak_gbs
    compute = flops / (prefill_tops * relative_compute)

- `head_ops` = layers x (heads + 2 x KV heads, + heads + KV heads with q/k norm): upstream's lowering splits
  attention into single-head ops (use_mha2sha), so a model with many heads pays a per-op cost that its bytes do not
  show (Qwen3-0.6B's 16 heads of 128 against Qwen2.5-0.5B's 14 of 64: ~2x slower at similar bytes); a model with
  an RMSNorm on each q and k head (Qwen3, Gemma 3) runs one more single-head op per q and per k head.
- the achieved bandwidth grows with the NPU generation, not only with DRAM's peak: SM8650 -> SM8750 gave
  1.21-1.45x on the same programs where peak bandwidth grew 1.10x.
- each single-head attention op reads its KV head's cache, so a model with grouped-query attention reads each
  cache once per query head (heads / kv_heads times); QNN's DDR count of a compiled program does not show these
  reads (they stay in the accelerator's caches), but they cost time: Qwen3's recipe at seq 1024 (8 KV heads, 2 query
  heads each) is no faster than 16a8w at context 128.
- the published figures come from two runtimes: ExecuTorch's runner (qexp's programs, `genie` 0) and Qualcomm's
  Genie (AI Hub's, `genie` 1), which streams the same bytes faster (Llama-3.2-1B at 4 bits: 64 tok/s on SM8750
  under Genie, a 45 tok/s floor under ExecuTorch); its speed-up is fitted, and qexp's estimates are ExecuTorch's.
- a decode step's compute is negligible beside its bytes; a prefill chunk of 128 tokens is compute-bound.
It cannot know a phone's thermal state, other apps, the runner's own overheads, or the DRAM clock a phone runs at.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, List, Optional

import numpy as np

from qexp.speed.bytes import Shapes, StreamBytes

# v2: per-head q/k norms are single-head ops; v3: KV read per query head, Genie runtime; v4: the published figures
# relabelled from their sources, floors fitted as lower bounds, the KV-read term dropped (held at 0) on
# leave-one-model-out error, an interval on every estimate
VERSION = "roofline-v4"


def head_ops(shapes: Shapes) -> int:
    """Single-head ops of one call: q, k, v per head (use_mha2sha), and a q and a k norm per head with q/k norm."""
    norms = shapes.n_heads + shapes.n_kv_heads if shapes.qk_norm else 0
    return shapes.n_layers * (shapes.n_heads + 2 * shapes.n_kv_heads + norms)


def flops(shapes: Shapes, ar_len: int, context: int) -> float:
    """Multiply-adds x 2 of one call: every linear on ar_len tokens, and attention over the whole cache."""
    attention = 2 * 2 * ar_len * context * shapes.n_heads * shapes.head_dim * shapes.n_layers
    return 2.0 * shapes.linear_params() * ar_len + attention


@dataclass(frozen=True)
class SpeedModel:
    bandwidth_efficiency: float  # fraction of the peak DRAM bandwidth a weight stream gets at relative_compute 1
    compute_exponent: float  # achieved bandwidth ~ peak x relative_compute ** this
    head_op_us: float  # fixed cost per layer and single-head attention op at relative_compute 1, microseconds
    kv_extra: float  # extra cost of a KV-cache byte read by one query head, in units of a byte at the peak bandwidth
    genie_speedup: float = 1.0  # achieved bandwidth of Qualcomm's Genie runtime over ExecuTorch's runner
    prefill_tops: float = 10.0  # effective tera-ops/s of a prefill chunk at relative_compute 1

    def as_dict(self) -> dict:
        return asdict(self)

    def call_seconds(self, shapes: Shapes, streamed: StreamBytes, soc, ar_len: int, context: int) -> float:
        """One call of the AR-`ar_len` graph on `soc` (a qexp.speed.data.Soc)."""
        return float(self.seconds(CallFeatures.of(shapes, streamed, soc, ar_len, context)))

    def seconds(self, f: "CallFeatures"):
        """call_seconds on features (numpy arrays of many calls at once, as the fit evaluates them)."""
        fixed = f.head_ops * self.head_op_us * 1e-6 / f.relative_compute
        bandwidth = (self.bandwidth_efficiency * f.peak_gbs * 1e9 * f.relative_compute ** self.compute_exponent
                     * self.genie_speedup ** f.genie)
        memory = f.total_bytes / bandwidth + self.kv_extra * f.kv_head_reads / (f.peak_gbs * 1e9)
        compute = f.flops / (self.prefill_tops * 1e12 * f.relative_compute)
        return fixed + np.maximum(memory, compute)

    def ttft_seconds(self, shapes: Shapes, chunk: StreamBytes, soc, ar_len: int, context: int, prompt: int) -> float:
        """The prompt in ceil(prompt / ar_len) calls of the AR-N graph (the first token comes from the last)."""
        return math.ceil(prompt / ar_len) * self.call_seconds(shapes, chunk, soc, ar_len, context)


@dataclass(frozen=True)
class CallFeatures:
    """What the model reads of one graph call (floats, or numpy arrays over many calls)."""

    head_ops: Any
    total_bytes: Any
    kv_head_reads: Any  # the KV cache's bytes times the query heads that read each KV head
    flops: Any
    peak_gbs: Any
    relative_compute: Any
    genie: Any = 0.0  # 1: the figure is Qualcomm's Genie runtime's, 0: ExecuTorch's runner (every qexp program)

    @classmethod
    def of(cls, shapes: Shapes, streamed: StreamBytes, soc, ar_len: int, context: int,
           runtime: str = "executorch") -> "CallFeatures":
        reads = streamed.kv_cache * shapes.n_heads / shapes.n_kv_heads
        return cls(head_ops(shapes), streamed.total, reads, flops(shapes, ar_len, context), soc.peak_gbs,
                   soc.relative_compute, 1.0 if runtime == "genie" else 0.0)

    @classmethod
    def stack(cls, features: List["CallFeatures"]) -> "CallFeatures":
        return cls(*(np.array([getattr(f, field.name) for f in features], dtype=float) for field in fields(cls)))


@dataclass(frozen=True)
class SpeedEstimate:
    """A program's estimated speed on one SoC; `*_err` is the model's median leave-one-out relative error."""

    soc: str
    decode_tok_s: float
    decode_ms_per_token: float
    ttft_ms: float
    prefill_tok_s: float
    prompt_len: int
    prefill_ar_len: Optional[int]  # None: the prompt goes token by token through the decode graph (kv mode)
    decode_bytes: float  # bytes one decode step streams
    decode_err: float
    ttft_err: float
    source: str  # estimate:<model version>+<data hash>
    # the interval: the 10-90% band of the held-out errors on published figures (qexp/speed/fit.py: Fit.band)
    decode_low: float = float("nan")
    decode_high: float = float("nan")
    ttft_low: float = float("nan")
    ttft_high: float = float("nan")
    ttft_extrapolated: bool = False  # the model is outside the sizes the TTFT figures were fitted on

    def metrics(self) -> dict:
        return {"decode_tok_s_est": self.decode_tok_s, "decode_ms_per_token_est": self.decode_ms_per_token,
                "ttft_ms_est": self.ttft_ms, "prefill_tok_s_est": self.prefill_tok_s,
                "decode_bytes_per_token_est": self.decode_bytes, "decode_tok_s_est_err": self.decode_err,
                "ttft_ms_est_err": self.ttft_err, "decode_tok_s_est_low": self.decode_low,
                "decode_tok_s_est_high": self.decode_high, "ttft_ms_est_low": self.ttft_low,
                "ttft_ms_est_high": self.ttft_high, "ttft_ms_est_extrapolated": float(self.ttft_extrapolated)}

    def interval(self, metric: str = "decode") -> str:
        """`[231, 275]`: the estimate's interval, for a log line or a table cell."""
        low, high = (self.decode_low, self.decode_high) if metric == "decode" else (self.ttft_low, self.ttft_high)
        return f"[{low:.0f}, {high:.0f}]" if metric == "decode" or high >= 10 else f"[{low:.1f}, {high:.1f}]"
