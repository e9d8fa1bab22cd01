"""The backend seam: what a deployment backend is, what the pipeline hands it and what it returns.

A backend takes the calibrated model to a program for its target (HTP through QNN, XNNPACK on the CPU, ...), runs
it, and returns the deployed program's log-likelihoods on (a subset of) the evaluation windows plus its own
metrics (speed, sizes), tags and text artifacts. The pipeline scores those log-likelihoods against the FP and QDQ
phases itself (qexp/eval/compare.py), so every backend's perplexities are named and compared the same way.

To add a backend: a config dataclass (subclass of BackendConfig, the schema of conf/backend/<name>.yaml), a
Backend subclass with `name`, `config_class`, `validate` and `run`, decorated with `@register_backend`, imported in
qexp/backends/__init__.py. See docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Optional

if TYPE_CHECKING:  # typing only: this module stays import-light (the config schema imports it)
    from omegaconf import DictConfig

    from qexp.cache import Cache
    from qexp.data.windows import Windows
    from qexp.eval.perplexity import EvalResult
    from qexp.models.loaded import LoadedModel
    from qexp.models.static_llama import StaticLlama
    from qexp.quant.calibrate import QuantizedModel
    from qexp.core.timing import StageTimer

# The SoC QnnQuantizer annotates for when no backend names one (a QDQ-only run).
DEFAULT_SOC = "SM8650"


@dataclass
class BackendConfig:
    """Fields every backend config has; each backend subclasses it with its own settings."""

    name: str = "none"


@dataclass
class BenchConfig:
    """Speed measurement of a deployed program: TTFT, prefill and decode tokens/s (median after warm-up). The
    defaults suit the x86 HTP emulator (~6 s per SmolLM2 graph call, prefill or decode alike): one generation, no
    warm-up. Its times are the emulator's, not a phone's, so repeats buy no information there, and the runner has
    no first-call cost to warm away (the evaluation just ran the prefill graph; measured: the first generation was
    not slower than the next two). A backend on real hardware overrides them."""

    prompt_len: int = 32
    new_tokens: int = 4
    warmup: int = 0
    repeats: int = 1


@dataclass
class QdqPhase:
    """The calibrated program and its evaluation, when the run quantizes."""

    program: "QuantizedModel"
    result: "EvalResult"
    static: Optional["StaticLlama"]  # the static llama the program was exported from (transformed model)
    r3: bool  # whether that static llama applies upstream's R3 rotation (what the deploy graphs must repeat)

    def release_programs(self) -> None:
        """Drop the float programs (the QDQ GraphModule and the static llama's conv-layout weights): the backends
        compile from the model's weights and the cached observer statistics, so nothing reads them after the QDQ
        phase. On SmolLM2 they hold ~1.2 GiB (750 + 510 MiB of tensors) that the compile can reuse."""
        self.program.module = None
        self.static = None


@dataclass
class PhaseInputs:
    """What the pipeline hands a backend."""

    cfg: "DictConfig"
    model: "LoadedModel"  # the float model with every transform applied: what must be deployed
    windows: "Windows"
    fp: "EvalResult"  # the untransformed float model on all windows (the reference)
    qdq: Optional[QdqPhase]
    cache: "Cache"
    timer: "StageTimer"
    versions: Dict[str, str]


@dataclass
class PhaseResult:
    """What a backend returns. `deployed` holds the program's log-likelihoods on `deployed.windows` (a head of the
    run's windows: the pipeline scores FP and QDQ on exactly those); its full logits, when kept, give logits SQNR."""

    deployed: Optional["EvalResult"] = None
    metrics: Dict[str, float] = field(default_factory=dict)
    tags: Dict[str, str] = field(default_factory=dict)
    texts: Dict[str, str] = field(default_factory=dict)  # artifact path -> content
    task_scorer: Optional[Any] = None  # the deployed program as a task scorer (qexp.tasks.deployed.DeployedScorer)


class Backend:
    """One deployment backend. Subclasses set `name` and `config_class` and implement `validate` and `run`."""

    name: ClassVar[str]
    config_class: ClassVar[type] = BackendConfig
    deploys: ClassVar[bool] = True  # False only for `none`: the run stops after the CPU phases

    def validate(self, cfg: "DictConfig") -> None:
        """Reject a config this backend cannot run, before any model is loaded (raise ConfigError)."""

    def quantizer_soc(self, cfg: "DictConfig") -> str:
        """The SoC QnnQuantizer annotates the calibration graph for."""
        return DEFAULT_SOC

    def scheme(self, cfg: "DictConfig") -> str:
        """What the deployed model is quantized with (the report's `scheme`): the QNN recipe unless the backend
        quantizes by its own settings."""
        return str(cfg.quant.name)

    def scoring_hint(self, qdq_arithmetic: Optional[str], metrics: dict) -> Optional[str]:
        """One line of advice once the deployed program is scored against the QDQ one (`metrics`; the QDQ phase's
        arithmetic, `fake_quant` or `htp_exact`), or None."""
        return None

    def run(self, inputs: PhaseInputs) -> PhaseResult:
        raise NotImplementedError

    def task_scorer(self, inputs: PhaseInputs):
        """The deployed program, built from the caches (or built), as a task scorer (qexp.tasks.deployed)."""
        from qexp.core.errors import ConfigError

        raise ConfigError(f"backend={self.name} has no deployed program that scores tasks",
                          "use backend=xnnpack or backend=htp")
