"""The programs of a run's phases (its RunState) as task scorers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qexp.core.errors import ConfigError
from qexp.tasks.head_rows import head_rows
from qexp.tasks.packing import PackedScorer


PHASES = ("fp", "qdq", "deployed")  # deployed: the run's backend's program (XNNPACK .pte, HTP on the emulator)


@dataclass
class PhaseProgram:
    phase: str
    scorer: PackedScorer
    tokenizer: Any  # qexp.models.tokenizer.Tokenizer
    add_bos: bool


def fp_program(state) -> PhaseProgram:
    """The untransformed float model: the reference every other phase is compared with."""
    static = state.fp_static
    scorer = PackedScorer(static.module, static, "FP tasks", head_rows(static.module, static.ar_len), state.device)
    return PhaseProgram("fp", scorer, state.model.tokenizer, state.model.add_bos)


def qdq_program(state) -> PhaseProgram:
    """The run's QDQ program, weights folded as its perplexity phase runs it (HTP's arithmetic with eval.htp_exact)."""
    from qexp.quant.fold import with_weights_dequantized
    from qexp.quant.w4_lowering import htp_exact_lowering

    folded = with_weights_dequantized(state.qdq.program.module, htp_exact_lowering(state.cfg))
    static = state.qdq.static  # the folded copy is the scorer's own: its head is rewritten to take rows
    scorer = PackedScorer(folded, static, "QDQ tasks", head_rows(folded, static.ar_len), state.device)
    return PhaseProgram("qdq", scorer, state.model.tokenizer, state.model.add_bos)


def deployed_program(state) -> PhaseProgram:
    """The run's deployed program from the caches (built where missing), scoring one request per call."""
    if not state.backend.deploys:
        raise ConfigError(f"phase=deployed: backend={state.cfg.backend.name} deploys nothing",
                          "use backend=xnnpack or backend=htp, or phase=fp / qdq")
    scorer = state.backend.task_scorer(state.phase_inputs())
    return PhaseProgram("deployed", scorer, state.model.tokenizer, state.model.add_bos)


def program_of(state, phase: str) -> PhaseProgram:
    if phase == "fp":
        return fp_program(state)
    if phase == "deployed":
        return deployed_program(state)
    if phase == "qdq":
        if state.qdq is None:
            raise ConfigError("phase=qdq: this run does not quantize (quant=fp32)", "use phase=fp")
        return qdq_program(state)
    raise ConfigError(f"phase={phase}: tasks score the phases {', '.join(PHASES)}", "choose one of them")
