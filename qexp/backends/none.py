"""backend=none: no deployment; the run ends after the FP and QDQ phases."""

from __future__ import annotations

from qexp.backends.base import Backend, BackendConfig, PhaseInputs, PhaseResult
from qexp.backends.registry import register_backend


@register_backend
class NoBackend(Backend):
    name = "none"
    config_class = BackendConfig
    deploys = False

    def run(self, inputs: PhaseInputs) -> PhaseResult:
        return PhaseResult()
