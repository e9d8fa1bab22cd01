"""Settings of the HTP backend (conf/backend/htp.yaml): SoC, model mode, graph shapes, KV updater, on-target
evaluation budget, speed bench, and the Android target."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from qexp.backends.base import BackendConfig, BenchConfig
from qexp.quant.w4_lowering import DEFAULT_W4_LOWERING, W4Lowering


class Soc(enum.Enum):
    """Snapdragon SoCs with a Hexagon NPU (QcomChipset names)."""

    SM8550 = "SM8550"  # Snapdragon 8 Gen 2
    SM8650 = "SM8650"  # Snapdragon 8 Gen 3
    SM8750 = "SM8750"  # Snapdragon 8 Elite
    SM8850 = "SM8850"  # Snapdragon 8 Elite Gen 5
    SA8797 = "SA8797"  # automotive, Hexagon v81: no phone figures, but QNN simulates its graphs' cycles at compile time


class ModelMode(enum.Enum):
    kv = "kv"  # one kv_forward graph (AR-1): prompt and decode token by token
    hybrid = "hybrid"  # prefill_forward (AR-N) for the prompt, then kv_forward
    lookahead = "lookahead"  # AR-N prompt processing + lookahead decoding (lossless)


class Target(enum.Enum):
    # HTP emulated on this host by the x86_64 QNN libraries: timings are NOT phone timings
    x86_emulator = "x86_emulator"
    android = "android"  # a phone over adb with a user-built qnn_llama_runner


class Contexts(enum.Enum):
    """How a multi-graph program's graphs (hybrid / lookahead: kv_forward and prefill_forward) are put into QNN
    contexts. Same computation either way (bit-identical emulator outputs, tests/test_htp.py)."""

    per_graph = "per_graph"  # each graph lowered on its own into its own context: in parallel workers or in turn
    shared = "shared"  # upstream's one lowering call: one context holding every graph (one process, ~1.5x the peak)


class KvUpdate(enum.Enum):
    smart_mask = "smart_mask"  # write each new token's K/V at its position and unmask it (what upstream ships)
    shift_pointer = "shift_pointer"  # slide the cache window by advancing its start pointer


@dataclass
class HtpBenchConfig(BenchConfig):
    """The emulator's speed bench: its timings are this x86 host's, so it runs only when asked for (every HTP run
    logs the phone estimate instead, qexp/speed); lookahead runs it to check that decoding stays lossless."""

    emulator: bool = False


@dataclass
class HtpConfig(BackendConfig):
    name: str = "htp"
    soc: Soc = Soc.SM8650
    model_mode: ModelMode = ModelMode.hybrid
    prefill_ar_len: int = 32  # tokens per prefill_forward call (hybrid / lookahead, and on-target perplexity)
    max_seq_len: int = 256  # context of the deployed graphs; must equal export.max_context_len (the calibration)
    kv_update: KvUpdate = KvUpdate.smart_mask
    w4_lowering: W4Lowering = DEFAULT_W4_LOWERING
    # QNN contexts of a multi-graph program: per_graph (each graph lowered on its own) or shared (upstream's one call)
    contexts: Contexts = Contexts.per_graph
    # per_graph: graphs lowered at once, each in its own process (QNN lowering is single-threaded Python work);
    # 1 = one after the other in this process, the lowest peak memory. A speed setting: same program, same cache entry.
    compile_workers: int = 2
    # QNN contexts per graph, split evenly by decoder layers (upstream's --num_sharding: ExecuTorch's SplitGraph pass
    # and multi-context HTP specs). Each shard is compiled on its own, so the compile's peak memory is one shard's.
    num_sharding: int = 1
    target: Target = Target.x86_emulator
    pte_path: Optional[str] = None  # run this pre-generated .pte instead of compiling
    # On-target perplexity is scored on a head of the evaluation windows: this many tokens through the AR-N prefill
    # graph (whole windows first), or eval_kv_tokens token by token when the mode has only the kv graph.
    eval_tokens: int = 256
    eval_kv_tokens: int = 32
    # model_mode=lookahead: n-gram size, Jacobi window and verification candidates per decode call
    ngram: int = 3
    window: int = 2
    gcap: int = 2
    bench: HtpBenchConfig = field(default_factory=HtpBenchConfig)  # its defaults are sized for the emulator
    # target=android (a phone over adb; not verifiable on this machine)
    serial: Optional[str] = None  # adb serial (null = the only attached device)
    runner: Optional[str] = None  # a user-built qnn_llama_runner (ExecuTorch Qualcomm backend, Android)
    qnn_lib_dir: Optional[str] = None  # the device's QNN libraries (libQnnHtp.so, libQnnHtpV*Stub.so, skels, ...)
