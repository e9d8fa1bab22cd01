"""The mixed-precision search's settings (conf/search.yaml; the `search` section of the top-level config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from qexp.core.metrics import LOWER, better
from qexp.core.sensitivity_config import SelectionConfig

# each objective -> the trial metric it reads (qexp/search/trial.py); its direction is the metric catalog's
OBJECTIVE_METRICS = {"ppl": "ppl_vs_fp_selection", "bits": "bits", "decode_tok_s": "decode_tok_s_est"}
SEARCH_OBJECTIVES = {name: "minimize" if better(metric) == LOWER else "maximize"
                     for name, metric in OBJECTIVE_METRICS.items()}
SEARCH_KINDS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class SearchConfig:
    """`python -m qexp.search -m` (conf/search.yaml): a multi-objective search over mixed-precision recipes by
    Hydra's Optuna sweeper, on top of a sensitivity analysis (the `sensitivity` section; its table orders each
    projection's layers)."""

    # The trial's recipe: per projection kind, how many of its layers are at `sensitivity.high` (the most useful
    # first by the sensitivity table), and the lm head (1: high). The sweeper sets them (qexp/search/space.py).
    promote: Dict[str, int] = field(default_factory=lambda: {k: 0 for k in (*SEARCH_KINDS, "lm_head")})
    # what each trial returns to the sweeper, in the order of hydra.sweeper.direction: ppl (ppl / ppl_fp - 1 on the
    # selection windows), bits (per decoder-linear weight), decode_tok_s (HTP estimate on `soc`, qexp/speed)
    objectives: List[str] = field(default_factory=lambda: ["ppl", "bits"])
    # the trials' selection windows (from the calibration half, as the analysis'; more and longer than the analysis'
    # by default: the first few windows of a text can be easier than the rest, and a recipe is judged on all of them)
    selection: SelectionConfig = field(default_factory=lambda: SelectionConfig(seq_len=256, limit=32))
    soc: str = "SM8650"  # the SoC of the decode speed estimate (a metric of every trial; an objective if chosen)
    # the greedy recipes at these average bits (qexp/sensitivity/synthesis.py) are the first trials
    seed_bits: List[float] = field(default_factory=lambda: [4.25, 4.5, 5.0])
    # where the Pareto front's recipes go as conf/quant-style YAMLs at the end of the search; empty: only the
    # parent run's artifacts
    recipe_dir: str = ""
