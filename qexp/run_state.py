"""What one run carries: its plan (the backend and algorithms a config check builds, once), its state (everything
the stages produce, in order, and the run's metrics, tags and artifacts as they appear) and its result."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
from omegaconf import DictConfig

from qexp.backends import Backend, PhaseInputs, QdqPhase
from qexp.cache import Cache
from qexp.core.config import NO_QUANT
from qexp.core.timing import StageTimer
from qexp.tracking.store import Tracker


@dataclass
class ExperimentResult:
    run_id: Optional[str]
    metrics: Dict[str, float] = field(default_factory=dict)
    tags: Dict[str, str] = field(default_factory=dict)
    skipped: bool = False  # a sweep job whose config already had a FINISHED run
    name: str = ""  # the MLflow run's name and description (what the UI shows first)
    description: str = ""


@dataclass
class RunPlan:
    """What checking a config builds and the run then uses: its backend and its algorithms (each built once)."""

    backend: Backend
    transforms: List[Any] = field(default_factory=list)  # ModelTransforms in config order (qexp/transforms)


@dataclass
class RunState:
    """Everything the stages of one run produce, in order. Attributes stay None until their stage ran."""

    cfg: DictConfig
    backend: Backend
    transforms: List[Any] = field(default_factory=list)  # the run's algorithms, built once by validate()
    tracked: bool = False  # log params and artifacts to the active MLflow run as they appear
    cache: Cache = None
    timer: StageTimer = field(default_factory=StageTimer)
    metrics: Dict[str, float] = field(default_factory=dict)
    tags: Dict[str, str] = field(default_factory=dict)
    per_window: Dict[str, Any] = field(default_factory=dict)
    model: Any = None  # LoadedModel as loaded (the FP reference)
    fp_static: Any = None  # its static llama
    corpus: Any = None
    windows: Any = None
    fp: Any = None  # EvalResult of the FP phase
    calibration: Any = None
    deploy_model: Any = None  # the model with every transform applied: what QDQ and the backend use
    deploy_static: Any = None  # the static llama of deploy_model
    qdq: Optional[QdqPhase] = None
    task_results: List[Any] = field(default_factory=list)  # the CPU phases' TaskResults (the deployed one pairs them)

    device: Any = None  # torch.device of the torch phases (qexp/core/device.py), resolved from cfg.device
    _phase_inputs: Optional[PhaseInputs] = None

    def __post_init__(self):
        from qexp.core.device import run_device

        self.cache = self.cache or Cache(self.cfg.cache_dir, self.cfg.cache.lock_timeout_s)
        self.device = self.device or run_device(self.cfg)

    def phase_inputs(self) -> PhaseInputs:
        """What the backend's phase reads (the deployed model, the windows, the FP and QDQ results), built once: the
        deploy stage and the tasks' deployed program share it."""
        if self._phase_inputs is None:
            from qexp.core.provenance import library_versions

            self._phase_inputs = PhaseInputs(self.cfg, self.deploy_model, self.windows, self.fp, self.qdq, self.cache,
                                             self.timer, library_versions())
        return self._phase_inputs

    def log_params(self, params: Dict[str, Any]) -> None:
        if self.tracked:
            Tracker.params(params)

    def log_text(self, content: str, path: str) -> None:
        if self.tracked:
            Tracker.text(content, path)

    def log_dataset(self, features, name: str, digest: str, source: str, context: str, **tags: Any) -> None:
        if self.tracked:
            Tracker.dataset(features, name, digest, source, context, tags)

    def log_array(self, array: np.ndarray, artifact_path: str) -> None:
        if self.tracked:
            with tempfile.TemporaryDirectory() as tmp:
                local = Path(tmp) / Path(artifact_path).name
                np.save(local, array)
                Tracker.file(local, str(Path(artifact_path).parent))

    @property
    def quantized(self) -> bool:
        return self.cfg.quant.scheme != NO_QUANT
