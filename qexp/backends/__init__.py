"""Deployment backends, registered by name (qexp/backends/registry.py). Importing this package registers them all
with their config schemas, and qexp.core.config's top-level schema: what Hydra needs to compose conf/. Each backend's
heavy imports (ExecuTorch lowering, QNN libraries) happen only when it runs."""

import qexp.core.config  # noqa: F401 - registers the top-level schema

from qexp.backends import htp, none, xnnpack  # noqa: F401 - registration
from qexp.backends.base import Backend, BackendConfig, PhaseInputs, PhaseResult, QdqPhase
from qexp.backends.registry import BACKENDS, get_backend, register_backend

__all__ = ["BACKENDS", "Backend", "BackendConfig", "PhaseInputs", "PhaseResult", "QdqPhase", "get_backend",
           "register_backend"]
