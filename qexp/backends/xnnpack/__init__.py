"""XNNPACK backend (this machine's CPU): ExecuTorch's LLM export with its own quantization (`qmode`), run as a
.pte with real CPU speed. Modules: config, export (model -> .pte), runner (the .pte through the pybindings),
roofline (decode bytes vs measured bandwidth), phase (the phase the pipeline runs)."""

from __future__ import annotations

from qexp.backends.base import Backend, PhaseInputs, PhaseResult
from qexp.backends.registry import register_backend
from qexp.backends.xnnpack.config import BROKEN_QMODES, GROUPED, QMODES, XnnpackConfig
from qexp.core.config import NO_QUANT
from qexp.core.errors import ConfigError


@register_backend
class XnnpackBackend(Backend):
    name = "xnnpack"
    config_class = XnnpackConfig

    def scheme(self, cfg) -> str:
        return str(cfg.backend.qmode)  # XNNPACK quantizes by its own qmode; the QNN recipe is fp32

    def validate(self, cfg) -> None:
        backend = cfg.backend
        if cfg.quant.scheme != NO_QUANT:
            raise ConfigError(
                f"quant={cfg.quant.name} is a QNN (HTP) scheme; backend=xnnpack quantizes with backend.qmode",
                f"use quant=fp32 with backend=xnnpack backend.qmode=8da4w (or {', '.join(QMODES)})",
            )
        if backend.qmode in BROKEN_QMODES:
            raise ConfigError(f"backend.qmode={backend.qmode}: {BROKEN_QMODES[backend.qmode]}",
                              f"use one of: {', '.join(QMODES)}")
        if backend.qmode not in QMODES:
            raise ConfigError(f"unknown backend.qmode {backend.qmode!r}", f"choose one of: {', '.join(QMODES)}")
        if backend.qmode in GROUPED and backend.group_size <= 0:
            raise ConfigError(f"backend.group_size={backend.group_size}", "use a positive group size, e.g. 32")
        if backend.embedding_quantize:
            parts = str(backend.embedding_quantize).split(",")
            if len(parts) != 2 or parts[0] not in ("4", "8") or not parts[1].isdigit():
                raise ConfigError(f"backend.embedding_quantize={backend.embedding_quantize!r}",
                                  "use '<bits>,<group size>' with bits 4 or 8 and group 0 (per row) or e.g. 32: '8,0'")
        if backend.threads < 1:
            raise ConfigError(f"backend.threads={backend.threads}", "use at least 1 thread")

    def run(self, inputs: PhaseInputs) -> PhaseResult:
        from qexp.backends.xnnpack.phase import run_phase

        return run_phase(inputs)

    def task_scorer(self, inputs: PhaseInputs):
        from qexp.backends.xnnpack.phase import task_scorer

        return task_scorer(inputs)
