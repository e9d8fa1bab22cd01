"""`--model qexp` for lm-eval's command line: a phase's program rebuilt from qexp's caches, for a logged run's
config (`run=<MLflow run id>`) or for Hydra overrides of conf/ (`overrides=quant=16a8w model=...`), as `QexpLM`.
Importing this module registers it (`python -m qexp.tasks lm_eval` does)."""

from __future__ import annotations

from typing import Optional

import lm_eval.models  # noqa: F401 - lm-eval fills its registry with its own models only while it is empty: first
from lm_eval.api.registry import register_model

from qexp.core.errors import ConfigError
from qexp.tasks.lm import QexpLM
from qexp.tasks.programs import PHASES, PhaseProgram, program_of


@register_model("qexp")
class QexpCliLM(QexpLM):
    def __init__(self, run: Optional[str] = None, overrides: Optional[str] = None, phase: str = "qdq",
                 tracking_uri: Optional[str] = None, **_lm_eval_settings):
        """lm-eval's `--model_args`: `run` or `overrides`, `phase` (fp | qdq | deployed: the backend's program,
        one request per call), `tracking_uri` (the store of `run`;
        default: MLflow's, then qexp's embedded store). lm-eval's `batch_size` and `device` do not apply: calls are
        packed to the graph's length, on the CPU."""
        program = phase_program(run, overrides, str(phase), tracking_uri)
        super().__init__(program.scorer, program.tokenizer, program.add_bos)


def phase_program(run: Optional[str] = None, overrides: Optional[str] = None, phase: str = "qdq",
                  tracking_uri: Optional[str] = None) -> PhaseProgram:
    """The program of `phase` for a logged run's config or for Hydra overrides, from qexp's caches (the float model
    conversion, the transforms and the calibrated QDQ program are not recomputed when cached). The run's stages up
    to the phase run untracked on one evaluation window (the windows do not change the program)."""
    from qexp.compose import compose, logged_config
    from qexp.pipeline import prepare

    if phase not in PHASES:
        raise ConfigError(f"phase={phase}: tasks score the phases {', '.join(PHASES)}", "choose one of them")
    if run and overrides:
        raise ConfigError("both run= and overrides=", "pass one of them")
    cfg = logged_config(run, tracking_uri) if run else compose((overrides or "").split())
    cfg.eval.limit = 1
    cfg.eval.tasks, cfg.eval.task_paths = [], []  # this process is lm-eval's: its own tasks, not the run's
    state = prepare(cfg, through="fp" if phase == "fp" else "qdq")
    return program_of(state, phase)
