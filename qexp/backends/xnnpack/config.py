"""Settings of the XNNPACK backend (conf/backend/xnnpack.yaml): ExecuTorch's LLM export quantization, threads,
and a speed bench sized for a real CPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from qexp.backends.base import BackendConfig, BenchConfig

# ExecuTorch LLM export qmodes that work here: dynamic 8-bit activations with 4-bit grouped / 8-bit per-channel weights.
QMODES = ("fp32", "8da4w", "8da8w")
GROUPED = ("8da4w",)  # group-wise weights; 8da8w is per channel
# Weight-only modes export_llama offers but that do not work with ExecuTorch 1.5.1 on this CPU (measured, tiny model).
BROKEN_QMODES = {
    "int8": "export fails in ExecuTorch 1.5.1 (a and b must have same reduction dim, [s, 64] X [32, 64])",
    "4w": "the exported program's logits are wrong on CPU in ExecuTorch 1.5.1 (cosine 0.05 to the eager model)",
}


@dataclass
class XnnpackBenchConfig(BenchConfig):
    # A real CPU runs a 135M model in milliseconds per token: measure more tokens, more often than on the emulator.
    prompt_len: int = 32
    new_tokens: int = 64
    warmup: int = 2
    repeats: int = 5


@dataclass
class XnnpackConfig(BackendConfig):
    name: str = "xnnpack"
    qmode: str = "8da4w"  # one of QMODES
    group_size: int = 32  # 8da4w weight groups (SmolLM2's dims are multiples of 32 and 64, not 128)
    embedding_quantize: Optional[str] = None  # "<bits>,<group>", e.g. "8,0" (per row) or "4,32"
    threads: int = 2
    bench: XnnpackBenchConfig = field(default_factory=XnnpackBenchConfig)
